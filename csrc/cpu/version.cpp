// Library identity, so Python can tell which build it loaded.
#include "lowcomm/abi.h"

LOWCOMM_EXPORT const char* lc_version(void) { return "lowcomm_cpu 0.1.0"; }

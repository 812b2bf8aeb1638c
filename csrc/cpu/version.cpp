// Library identity, so Python can tell which build it loaded, and the last failure message.
#include "lowcomm/abi.h"
#include "lowcomm/status.h"

LOWCOMM_EXPORT const char* lc_version(void) { return "lowcomm_cpu 0.1.0"; }

LOWCOMM_EXPORT const char* lc_last_error(void) { return lowcomm::last_error_buffer(); }

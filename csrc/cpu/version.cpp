// Library identity, so Python can tell which build it loaded.
#define LOWCOMM_EXPORT extern "C" __attribute__((visibility("default")))

LOWCOMM_EXPORT const char* lc_version(void) { return "lowcomm_cpu 0.1.0"; }

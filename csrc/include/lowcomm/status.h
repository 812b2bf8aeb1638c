// Failure messages of the C ABI, shared by both libraries (each has its own copy of the buffer).
//
// An entry point that fails returns its LC_E* code after writing one line for lc_last_error() /
// lc_cuda_last_error(): the entry point's name, then the argument at fault and its value, or the
// CUDA call and its error name and string. The line belongs to the calling thread and stays until
// that thread's next failure; it is meaningful only right after a non-zero return.
#ifndef LOWCOMM_STATUS_H_
#define LOWCOMM_STATUS_H_

#include <stdarg.h>
#include <stdio.h>

#include "lowcomm/abi.h"

namespace lowcomm {

constexpr int kErrorChars = 512;

inline char* last_error_buffer() {
  static thread_local char text[kErrorChars] = "";
  return text;
}

// Writes "<op>: <printf(fmt, ...)>" as the calling thread's last error and returns `code`.
__attribute__((format(printf, 3, 4))) inline int fail(int code, const char* op, const char* fmt, ...) {
  char* text = last_error_buffer();
  int k = snprintf(text, kErrorChars, "%s: ", op);
  if (k < 0 || k >= kErrorChars) return code;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(text + k, static_cast<size_t>(kErrorChars - k), fmt, ap);
  va_end(ap);
  return code;
}

inline const char* dtype_name(int code) {
  switch (code) {
    case LC_F32: return "f32";
    case LC_F64: return "f64";
    case LC_BF16: return "bf16";
    case LC_F16: return "f16";
    default: return "unknown";
  }
}

// LC_EBADTYPE for an unsupported data dtype.
inline int bad_dtype(const char* op, int dtype) {
  return fail(LC_EBADTYPE, op, "dtype = %d (%s) is not supported (f32 = %d, f64 = %d, bf16 = %d or f16 = %d)",
              dtype, dtype_name(dtype), LC_F32, LC_F64, LC_BF16, LC_F16);
}

// LC_EBADTYPE for an unsupported (data dtype, storage dtype) pair; `storage` names the argument.
inline int bad_dtypes(const char* op, int dtype, const char* storage, int storage_dtype) {
  return fail(LC_EBADTYPE, op,
              "dtype = %d (%s) with %s = %d (%s) is not supported (the pairs are f32/f32, f32/bf16, "
              "f64/f64, f64/bf16, bf16/f32, bf16/bf16, f16/f32, f16/bf16)",
              dtype, dtype_name(dtype), storage, storage_dtype, dtype_name(storage_dtype));
}

}  // namespace lowcomm

#endif  // LOWCOMM_STATUS_H_

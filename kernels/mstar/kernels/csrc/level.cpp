// What makes one level's library its own Python module: the ISA level its kernel objects were
// compiled for and the module's init function, both named by build.py's defines.
#include <Python.h>

#include "kernels.h"

#if !defined(MSTAR_ISA_LEVEL) || !defined(MSTAR_PYINIT) || !defined(MSTAR_MODULE)
#error "build.py defines MSTAR_ISA_LEVEL, MSTAR_PYINIT and MSTAR_MODULE for every level"
#endif

// Defined in bindings.cpp (compiled once for every level).
PyObject* mstar_cpu_module(const char* name);

namespace mstar_cpu {

const char* isa_level() { return MSTAR_ISA_LEVEL; }

}  // namespace mstar_cpu

extern "C" __attribute__((visibility("default"))) PyObject* MSTAR_PYINIT() {
  return mstar_cpu_module(MSTAR_MODULE);
}

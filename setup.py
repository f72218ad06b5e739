"""Build of the compiled kernels (``cython_kernels.qmatmul``); metadata lives in pyproject.toml.

OpenMP is used when the active compiler can compile and link a tiny OpenMP program:
``-fopenmp`` (gcc / clang / MinGW), ``/openmp`` (MSVC), and on macOS Apple clang with
``-Xpreprocessor -fopenmp -lomp`` against Homebrew's libomp. Otherwise the extension is built
serial, with a warning. ``COLI_NO_OPENMP=1`` forces the serial build.

SIMD: the build targets the baseline of the platform (never ``-march=native``). The hot loops in
``cython_kernels/qkern.h`` carry AVX2+FMA and AVX-512 variants compiled per function
(``__attribute__((target(...)))``, gcc / clang on x86-64) and picked at run time from the CPU's
feature flags; other compilers / CPUs get the portable C variant (auto-vectorized; NEON on
arm64). ``-ffp-contract=off`` keeps the portable variant's bits independent of the compiler's
FMA contraction; the AVX2 / AVX-512 variants use explicit FMAs (see qmatmul.pyx, "Guarantees").
"""
import os
import shutil
import sys
import tempfile

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

OMP_TEST = r"""
#include <omp.h>
int main(void) {
    int n = 0;
    #pragma omp parallel reduction(+:n)
    n += 1;
    return (n > 0 && omp_get_max_threads() > 0) ? 0 : 1;
}
"""

HOMEBREW_LIBOMP = ("/opt/homebrew/opt/libomp", "/usr/local/opt/libomp")


def _openmp_candidates(compiler_type):
    """(label, compile args, link args, include dirs, library dirs, libraries) to try, in order."""
    if compiler_type == "msvc":
        return [("/openmp", ["/openmp"], [], [], [], [])]
    cands = [("-fopenmp", ["-fopenmp"], [], [], [], [])]
    if sys.platform == "darwin":
        for prefix in HOMEBREW_LIBOMP:
            inc, lib = os.path.join(prefix, "include"), os.path.join(prefix, "lib")
            if os.path.isdir(inc) and os.path.isdir(lib):
                cands.append((f"-Xpreprocessor -fopenmp -lomp ({prefix})",
                              ["-Xpreprocessor", "-fopenmp"], [f"-Wl,-rpath,{lib}"],
                              [inc], [lib], ["omp"]))
        cands.append(("-Xpreprocessor -fopenmp -lomp", ["-Xpreprocessor", "-fopenmp"], [],
                      [], [], ["omp"]))
    return cands


class BuildExt(build_ext):
    def _try_openmp(self, cand):
        _, cargs, largs, incs, libdirs, libs = cand
        tmp = tempfile.mkdtemp(prefix="coli_omp_")
        cwd = os.getcwd()
        try:
            os.chdir(tmp)  # relative paths keep the compiler's object naming simple
            with open("omp_test.c", "w") as f:
                f.write(OMP_TEST)
            objs = self.compiler.compile(["omp_test.c"], include_dirs=incs, extra_postargs=cargs)
            self.compiler.link_executable(objs, "omp_test", libraries=libs,
                                          library_dirs=libdirs, extra_postargs=cargs + largs)
            return True
        except Exception:
            return False
        finally:
            os.chdir(cwd)
            shutil.rmtree(tmp, ignore_errors=True)

    def _find_openmp(self):
        if os.environ.get("COLI_NO_OPENMP", "").strip() not in ("", "0"):
            print("colibri: COLI_NO_OPENMP set; building the kernels without OpenMP")
            return None
        for cand in _openmp_candidates(self.compiler.compiler_type):
            print(f"colibri: checking OpenMP with {cand[0]} ...")
            if self._try_openmp(cand):
                print(f"colibri: OpenMP enabled ({cand[0]})")
                return cand
        print("\n" + "*" * 78 + "\n"
              "WARNING (colibri): the C compiler cannot build OpenMP code; the kernels are\n"
              "built SINGLE-THREADED. For multi-threaded kernels install OpenMP support\n"
              "(Linux: gcc / libgomp or clang + libomp-dev; macOS: `brew install libomp`)\n"
              "and rebuild.\n" + "*" * 78 + "\n", file=sys.stderr)
        return None

    def build_extensions(self):
        msvc = self.compiler.compiler_type == "msvc"
        opt = ["/O2"] if msvc else ["-O3", "-ffp-contract=off"]
        omp = self._find_openmp()
        for ext in self.extensions:
            ext.extra_compile_args = list(ext.extra_compile_args or []) + opt
            if omp is not None:
                _, cargs, largs, incs, libdirs, libs = omp
                ext.extra_compile_args += cargs
                ext.extra_link_args = list(ext.extra_link_args or []) + cargs + largs
                ext.include_dirs = list(ext.include_dirs or []) + incs
                ext.library_dirs = list(ext.library_dirs or []) + libdirs
                ext.libraries = list(ext.libraries or []) + libs
        # The generated C does not change with the OpenMP choice, so an up-to-date check could
        # keep a stale serial/parallel binary: always rebuild (one small file).
        self.force = True
        super().build_extensions()


extensions = cythonize(
    [Extension("cython_kernels.qmatmul", ["cython_kernels/qmatmul.pyx"],
               include_dirs=["cython_kernels", numpy.get_include()],
               define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")], depends=["cython_kernels/qkern.h", "cython_kernels/qkern_neon.h",
                                                       "cython_kernels/layer_ops.h", "cython_kernels/layer_ops.pxi",
                                                       "cython_kernels/attention_block.h", "cython_kernels/fileio.h",
                                                       "cython_kernels/mla_block.h", "cython_kernels/mla_ops.pxi",
                                                       "cython_kernels/linear_attention.h", "cython_kernels/linear_ops.pxi",
                                                       "cython_kernels/kda_block.h", "cython_kernels/kda_ops.pxi",
                                                       "cython_kernels/prefill.h", "cython_kernels/prefill.pxi",
                                                       "cython_kernels/dense.h", "cython_kernels/dense.pxi",
                                                       "cython_kernels/fp4.h", "cython_kernels/fp4.pxi"])],
    compiler_directives={"language_level": 3, "boundscheck": False, "wraparound": False},
)

setup(ext_modules=extensions, cmdclass={"build_ext": BuildExt})

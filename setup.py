"""Builds the extension hicache._hicache with the project's CMake (a static libhicache linked into
it, no tests, no tools) and packages python/hicache around it.

Environment: HICACHE_CMAKE_ARGS (extra CMake arguments, e.g. -DHICACHE_CUDA=OFF),
HICACHE_PIP_BUILD_DIR (a CMake build directory kept between installs; default: setuptools'
temporary directory), CMAKE_BUILD_PARALLEL_LEVEL (jobs).
"""
import os
import shlex
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        out = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build = Path(os.environ.get("HICACHE_PIP_BUILD_DIR") or Path(self.build_temp) / "cmake")
        build = build.resolve()
        args = [
            "-DCMAKE_BUILD_TYPE=Release",
            "-DBUILD_SHARED_LIBS=OFF",
            "-DHICACHE_BUILD_TESTS=OFF",
            "-DHICACHE_BUILD_TOOLS=OFF",
            "-DHICACHE_PYTHON=ON",
            "-DHICACHE_INSTALL=OFF",
            f"-DPython3_EXECUTABLE={sys.executable}",
            f"-DHICACHE_PYTHON_OUTPUT_DIR={out}",
        ] + shlex.split(os.environ.get("HICACHE_CMAKE_ARGS", ""))
        generator = ["-G", "Ninja"] if subprocess.run(
            ["ninja", "--version"], capture_output=True).returncode == 0 else []
        subprocess.check_call(["cmake", "-S", str(ROOT), "-B", str(build)] + generator + args)
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 1))
        subprocess.check_call(["cmake", "--build", str(build), "--target", "hicache_python",
                               "-j", jobs])


setup(
    # hicache and every subpackage under python/hicache (hicache.sglang, ...)
    packages=find_packages("python", include=["hicache", "hicache.*"]),
    package_dir={"": "python"},
    ext_modules=[Extension("hicache._hicache", sources=[])],
    cmdclass={"build_ext": CMakeBuild},
)

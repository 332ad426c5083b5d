# Checks that a shared object of hicache's uses the shared C++ runtime (libstdc++.so.6 or
# libc++.so.1 among its NEEDED libraries). One that carries its own copy (a toolchain that links
# libstdc++ statically, e.g. a compiler wrapper adding -static-libstdc++) crashes in a process
# that also maps the system's runtime: Python with torch segfaulted in std::ostringstream inside
# HiCache's constructor. Run after each link (hicache_check_cxx_runtime in HicacheCxxRuntime.cmake):
#
#   cmake -DFILE=<shared object> -DREADELF=<readelf> [-DALLOW=ON] -P check_cxx_runtime.cmake
#
# Fails naming the file and the fix; with ALLOW=ON (HICACHE_ALLOW_STATIC_CXX_RUNTIME) it warns.
foreach(var FILE READELF)
  if(NOT ${var})
    message(FATAL_ERROR "check_cxx_runtime.cmake: -D${var}= is required")
  endif()
endforeach()
execute_process(COMMAND "${READELF}" -d "${FILE}" OUTPUT_VARIABLE dynamic
  ERROR_VARIABLE error RESULT_VARIABLE status)
if(NOT status EQUAL 0)
  message(FATAL_ERROR "hicache: '${READELF} -d ${FILE}' failed (${status}): ${error}")
endif()
if(dynamic MATCHES "\\(NEEDED\\)[^\n]*\\[lib(stdc|c)\\+\\+\\.so")
  return()
endif()
set(what "${FILE} carries its own copy of the C++ runtime (no libstdc++.so.6 among its \
NEEDED libraries: the toolchain linked libstdc++ statically, e.g. a compiler wrapper or linker \
flags with -static-libstdc++). A process that also loads the system's libstdc++.so.6 (Python \
with torch) then runs two C++ runtimes and crashes. Fix the toolchain: build with the system \
compiler (-DCMAKE_CXX_COMPILER=/usr/bin/g++) or remove -static-libstdc++ from the wrapper or \
flags.")
# The full text goes out unwrapped (NOTICE), so that a build log shows it on one line.
if(ALLOW)
  message(NOTICE "hicache: WARNING: ${what} HICACHE_ALLOW_STATIC_CXX_RUNTIME is on: preload the \
system runtime in every process that loads hicache beside torch (LD_PRELOAD=<path of \
libstdc++.so.6>).")
else()
  message(NOTICE "hicache: ${what} To build it anyway, -DHICACHE_ALLOW_STATIC_CXX_RUNTIME=ON (then preload \
the system runtime: LD_PRELOAD=<path of libstdc++.so.6>).")
  message(FATAL_ERROR "hicache: the C++ runtime check failed for ${FILE}")
endif()

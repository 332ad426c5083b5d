# hicache_check_cxx_runtime(target): after each link of the shared object `target`, checks that
# it uses the shared C++ runtime (cmake/check_cxx_runtime.cmake says why and what it prints).
# Skipped, said once at configure time, where CMake found no readelf.
option(HICACHE_ALLOW_STATIC_CXX_RUNTIME
  "Build libhicache.so / the Python module even when the toolchain links libstdc++ into them \
statically (a warning instead of an error; such a process needs the system's libstdc++ preloaded)"
  OFF)
if(NOT CMAKE_READELF)
  message(STATUS "hicache: no readelf found; the C++ runtime of the shared objects is not checked")
endif()
function(hicache_check_cxx_runtime target)
  if(NOT CMAKE_READELF)
    return()
  endif()
  add_custom_command(TARGET ${target} POST_BUILD
    COMMAND ${CMAKE_COMMAND} -DFILE=$<TARGET_FILE:${target}> -DREADELF=${CMAKE_READELF}
            -DALLOW=${HICACHE_ALLOW_STATIC_CXX_RUNTIME}
            -P ${PROJECT_SOURCE_DIR}/cmake/check_cxx_runtime.cmake
    VERBATIM)
endfunction()

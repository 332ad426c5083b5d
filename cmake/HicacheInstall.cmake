# `cmake --install` puts the library, its public headers (under include/hicache/<layer>/) and a
# CMake package in the prefix, so that another project can find_package(hicache) and link
# hicache::hicache.
include(CMakePackageConfigHelpers)

# The public surface, in one place: the headers an embedder includes. What they include from the
# project is installed with them (the closure is read from their #include lines at configure
# time); every other header is internal and stays in the source tree. Adding a header here is a
# promise to keep its contract; tests/consumer builds a file that includes each of them against
# the installed prefix alone.
set(HICACHE_PUBLIC_HEADERS
  controller/hicache.h          # HiCache: the front door (owns everything below)
  controller/config.h           # HiCacheConfig: the one schema (from_json_text / from_json_file)
  controller/hi_radix_cache.h   # HiRadixCache: what the engine's scheduler drives
  controller/kv_events.h        # KvEventPublisher: tier-tagged KV events for routers (ZeroMQ)
  storage/storage_backend.h     # StorageBackend (a store of one's own), make_storage
  storage/file_storage.h        # FileStorage and its config
  storage/redis_storage.h       # RedisStorage (+ cluster) and its config
  transfer/errors.h             # the exceptions the API throws
  transfer/metrics.h            # MetricsRegistry: JSON and Prometheus text
  pools/kv_pattern.h)           # key-derived page data, for an embedder's own byte checks

# Sets `out` to `entries` plus every project header they include, directly or not.
function(hicache_header_closure out)
  set(todo ${ARGN})
  set(seen "")
  while(todo)
    list(POP_FRONT todo header)
    if(header IN_LIST seen OR NOT EXISTS ${PROJECT_SOURCE_DIR}/${header})
      continue()
    endif()
    list(APPEND seen ${header})
    file(STRINGS ${PROJECT_SOURCE_DIR}/${header} lines REGEX "^#include \"[^\"]+\"")
    foreach(line ${lines})
      string(REGEX REPLACE "^#include \"([^\"]+)\".*" "\\1" included "${line}")
      list(APPEND todo ${included})
    endforeach()
  endwhile()
  list(SORT seen)
  set(${out} ${seen} PARENT_SCOPE)
endfunction()

hicache_header_closure(HICACHE_INSTALLED_HEADERS ${HICACHE_PUBLIC_HEADERS})
# The consumer test reads these (one per line) to include every public header and to check that
# nothing else was installed.
string(REPLACE ";" "\n" _hicache_public_lines "${HICACHE_PUBLIC_HEADERS}")
file(WRITE ${PROJECT_BINARY_DIR}/hicache_public_headers.txt "${_hicache_public_lines}\n")
string(REPLACE ";" "\n" _hicache_installed_lines "${HICACHE_INSTALLED_HEADERS}")
file(WRITE ${PROJECT_BINARY_DIR}/hicache_installed_headers.txt "${_hicache_installed_lines}\n")
set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${HICACHE_INSTALLED_HEADERS})
install(TARGETS hicache EXPORT hicacheTargets
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
foreach(header ${HICACHE_INSTALLED_HEADERS})
  get_filename_component(dir ${header} DIRECTORY)
  install(FILES ${PROJECT_SOURCE_DIR}/${header} DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/hicache/${dir})
endforeach()
install(EXPORT hicacheTargets NAMESPACE hicache:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/hicache)
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/hicacheConfig.cmake.in
  ${PROJECT_BINARY_DIR}/hicacheConfig.cmake INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/hicache)
write_basic_package_version_file(${PROJECT_BINARY_DIR}/hicacheConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/hicacheConfig.cmake ${PROJECT_BINARY_DIR}/hicacheConfigVersion.cmake
  DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/hicache)

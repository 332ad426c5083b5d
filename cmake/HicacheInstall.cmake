# `cmake --install` puts the library, its headers (under include/hicache/<layer>/) and a CMake
# package in the prefix, so that another project can find_package(hicache) and link
# hicache::hicache.
include(CMakePackageConfigHelpers)
install(TARGETS hicache EXPORT hicacheTargets
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
foreach(layer kernels transfer pools controller storage)
  install(DIRECTORY ${PROJECT_SOURCE_DIR}/${layer}/ DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/hicache/${layer}
    FILES_MATCHING PATTERN "*.h" PATTERN "*.cuh")
endforeach()
install(EXPORT hicacheTargets NAMESPACE hicache:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/hicache)
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/hicacheConfig.cmake.in
  ${PROJECT_BINARY_DIR}/hicacheConfig.cmake INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/hicache)
write_basic_package_version_file(${PROJECT_BINARY_DIR}/hicacheConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/hicacheConfig.cmake ${PROJECT_BINARY_DIR}/hicacheConfigVersion.cmake
  DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/hicache)

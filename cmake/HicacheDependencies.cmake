# Dependencies come from Debian 12 packages; none is vendored or downloaded.
include(GNUInstallDirs)
set(THREADS_PREFER_PTHREAD_FLAG ON)
find_package(Threads REQUIRED)
find_package(nlohmann_json 3.10 REQUIRED)

# libconcurrentqueue-dev ships headers only, with no CMake or pkg-config file.
find_path(HICACHE_CONCURRENTQUEUE_INCLUDE_DIR concurrentqueue/blockingconcurrentqueue.h REQUIRED)
add_library(hicache_concurrentqueue INTERFACE)
target_include_directories(hicache_concurrentqueue SYSTEM INTERFACE ${HICACHE_CONCURRENTQUEUE_INCLUDE_DIR})

if(HICACHE_BUILD_TESTS)
  find_package(GTest REQUIRED)
endif()
if(HICACHE_BUILD_TOOLS)
  find_package(benchmark REQUIRED)
endif()

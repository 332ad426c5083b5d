# Dependencies come from Debian 12 packages; none is vendored or downloaded.
include(GNUInstallDirs)
set(THREADS_PREFER_PTHREAD_FLAG ON)
find_package(Threads REQUIRED)
find_package(nlohmann_json 3.10 REQUIRED)

# libconcurrentqueue-dev ships headers only, with no CMake or pkg-config file.
find_path(HICACHE_CONCURRENTQUEUE_INCLUDE_DIR concurrentqueue/blockingconcurrentqueue.h REQUIRED)
add_library(hicache_concurrentqueue INTERFACE)
target_include_directories(hicache_concurrentqueue SYSTEM INTERFACE ${HICACHE_CONCURRENTQUEUE_INCLUDE_DIR})

# Storage: SHA-256 page keys (libcrypto), record checksums (xxHash), the Redis client (Boost.Asio,
# its TLS over libssl, hiredis's RESP reader). hiredis and xxhash ship pkg-config files only.
find_package(OpenSSL 3.0 REQUIRED COMPONENTS Crypto SSL)
find_package(Boost 1.81 REQUIRED)
find_package(PkgConfig REQUIRED)
pkg_check_modules(HICACHE_XXHASH REQUIRED IMPORTED_TARGET libxxhash)
pkg_check_modules(HICACHE_HIREDIS REQUIRED IMPORTED_TARGET hiredis)
# Collectives across processes (TCP).
find_package(Gloo REQUIRED)

if(HICACHE_BUILD_TESTS)
  find_package(GTest REQUIRED)
endif()
if(HICACHE_BUILD_TOOLS)
  find_package(benchmark REQUIRED)
endif()

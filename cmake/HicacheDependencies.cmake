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
# KV events (controller/kv_events.cc): ZeroMQ through cppzmq (libzmq3-dev, cppzmq-dev), and
# msgpack-cxx, header-only and used without Boost. Debian's libmsgpack-cxx-dev depends on
# libboost-dev (1.74), which conflicts with libboost1.81-dev, so tools/setup.sh unpacks it into
# HICACHE_MSGPACK_PREFIX instead of installing it; a msgpack.hpp on the system paths comes first.
# Both stay private to the library: no public header includes them.
find_package(cppzmq REQUIRED)
set(HICACHE_MSGPACK_PREFIX /opt/hicache-deps/msgpack-cxx CACHE PATH
    "Where tools/setup.sh unpacks libmsgpack-cxx-dev (its usr/include holds msgpack.hpp)")
find_path(HICACHE_MSGPACK_INCLUDE_DIR msgpack.hpp PATHS ${HICACHE_MSGPACK_PREFIX}/usr/include)
if(NOT HICACHE_MSGPACK_INCLUDE_DIR)
  message(FATAL_ERROR "msgpack-cxx not found (msgpack.hpp): run tools/setup.sh, or unpack Debian's "
    "libmsgpack-cxx-dev (apt-get download; dpkg-deb -x) into HICACHE_MSGPACK_PREFIX "
    "(${HICACHE_MSGPACK_PREFIX}), or set HICACHE_MSGPACK_INCLUDE_DIR")
endif()
add_library(hicache_msgpack INTERFACE)
target_include_directories(hicache_msgpack SYSTEM INTERFACE ${HICACHE_MSGPACK_INCLUDE_DIR})
target_compile_definitions(hicache_msgpack INTERFACE MSGPACK_NO_BOOST)

if(HICACHE_BUILD_TESTS)
  find_package(GTest REQUIRED)
endif()
if(HICACHE_BUILD_TOOLS)
  find_package(benchmark REQUIRED)
endif()

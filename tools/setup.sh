#!/usr/bin/env bash
# The two set-up commands of the README, for a fresh Debian 12 machine (as root, or a user with
# sudo). Idempotent: installs only what is missing, rebuilds only what changed.
#
#   bash tools/setup.sh main   install, build, run the main job (hicache-bench on the default)
#   bash tools/setup.sh test   install, build, run the whole test suite (what CI runs)
#
# Environment: BUILD_DIR (default build), JOBS (default nproc), HICACHE_SANITIZERS=1 (test
# mode: also build and run the suite under ASan+UBSan and under TSan, in build-asan/ and
# build-tsan/, without CUDA and tools; then build the libFuzzer targets with clang in
# build-fuzz/ (the library checked by clang's -Wthread-safety on the way) and run each for a
# fixed number of inputs from a fixed seed, so the run is the same every time; CI sets it).
# HICACHE_FUZZ_RUNS (default 200000) sets that number.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-}
case "$mode" in main|test) ;; *) echo "usage: bash tools/setup.sh main|test" >&2; exit 2 ;; esac
say() { printf '[hicache setup] %s\n' "$*"; }

build_dir=${BUILD_DIR:-build}
jobs=${JOBS:-$(nproc)}
packages=(build-essential cmake ninja-build ccache pkg-config
  libconcurrentqueue-dev libboost1.81-dev nlohmann-json3-dev libgtest-dev libgmock-dev
  libbenchmark-dev libhiredis-dev libgloo-dev libssl-dev libxxhash-dev liburing-dev redis-server
  fio         # the baseline of hicache-storagebench
  openssl     # certificates for the Redis TLS tests
  prometheus  # promtool and a real server for the /metrics tests
  python3-dev python3-pybind11 pybind11-dev python3-torch python3-pytest  # the Python package
  python3-setuptools python3-pip  # pip install --no-build-isolation . (tests/python)
  libzmq3-dev cppzmq-dev python3-zmq python3-msgpack  # KV events (controller/kv_events.h)
  clang)      # libFuzzer for the fuzz targets (tests/fuzz)

sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  say "installing ${#missing[@]} missing Debian packages: ${missing[*]}"
  $sudo apt-get update -q
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
else
  say "all ${#packages[@]} Debian packages present"
fi

# msgpack-cxx (header-only) is unpacked, not installed: Debian's libmsgpack-cxx-dev depends on
# libboost-dev (1.74), which conflicts with libboost1.81-dev. CMake looks for it there
# (HICACHE_MSGPACK_PREFIX in cmake/HicacheDependencies.cmake) when the system has no msgpack.hpp.
msgpack_prefix=/opt/hicache-deps/msgpack-cxx
if [ ! -e /usr/include/msgpack.hpp ] && [ ! -e "$msgpack_prefix/usr/include/msgpack.hpp" ]; then
  say "unpacking libmsgpack-cxx-dev into $msgpack_prefix"
  deb_dir=$(mktemp -d) && chmod 755 "$deb_dir"  # readable by apt's _apt user
  (cd "$deb_dir" && apt-get download -q libmsgpack-cxx-dev) ||
    { $sudo apt-get update -q && (cd "$deb_dir" && apt-get download -q libmsgpack-cxx-dev); }
  $sudo mkdir -p "$msgpack_prefix"
  $sudo dpkg-deb -x "$deb_dir"/libmsgpack-cxx-dev_*.deb "$msgpack_prefix"
  rm -rf "$deb_dir"
fi

say "configuring $build_dir (CUDA is compiled when /usr/local/cuda is present)"
cmake -S . -B "$build_dir" -G Ninja -DHICACHE_WERROR=ON >/dev/null
say "building with $jobs jobs"
cmake --build "$build_dir" -j "$jobs"

if [ "$mode" = main ]; then
  say "running the main job: $build_dir/tools/hicache-bench"
  "$build_dir/tools/hicache-bench"
else
  say "running the test suite: ctest --test-dir $build_dir"
  ctest --test-dir "$build_dir" --output-on-failure -j "$jobs"
  if [ "${HICACHE_SANITIZERS:-0}" = 1 ]; then
    for san in asan tsan; do
      case $san in
        asan) flags="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer" ;;
        tsan) flags="-fsanitize=thread -Wno-tsan" ;;  # -Wtsan: moodycamel uses fences
      esac
      dir="$build_dir-$san"
      say "sanitizer build $dir ($flags)"
      # No Python package: an instrumented library cannot be loaded by an uninstrumented python3.
      cmake -S . -B "$dir" -G Ninja -DHICACHE_CUDA=OFF -DHICACHE_BUILD_TOOLS=OFF -DHICACHE_PYTHON=OFF \
        -DHICACHE_WERROR=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS="$flags" \
        -DCMAKE_EXE_LINKER_FLAGS="$flags" -DCMAKE_SHARED_LINKER_FLAGS="$flags" >/dev/null
      cmake --build "$dir" -j "$jobs"
      # The install test builds an uninstrumented consumer, which cannot load an instrumented
      # library; it runs in the normal build above.
      say "running the test suite under $san"
      TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 suppressions=$PWD/tests/tsan.supp" \
        ASAN_OPTIONS="detect_leaks=1" \
        LSAN_OPTIONS="suppressions=$PWD/tests/lsan.supp" \
        ctest --test-dir "$dir" --output-on-failure -j "$jobs" -E '^install\.'
      # The stress tool under the sanitizer too: every fault for 30 s on the file store (only
      # its own sources compile here; the library is built already).
      say "hicache-stress under $san (30 s, every fault)"
      cmake -S . -B "$dir" -DHICACHE_BUILD_TOOLS=ON >/dev/null
      cmake --build "$dir" -j "$jobs" --target hicache-stress
      TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 suppressions=$PWD/tests/tsan.supp" \
        ASAN_OPTIONS="detect_leaks=1" \
        LSAN_OPTIONS="suppressions=$PWD/tests/lsan.supp" \
        "$dir/tools/hicache-stress" --seconds 30 --no-progress --seed 3
    done
    dir="$build_dir-fuzz"
    # The one clang build, so it also runs clang's thread-safety analysis (HICACHE_THREAD_SAFETY):
    # it compiles the whole library without CUDA and the Python module (python/binding, whose
    # AsyncStore and EngineSlots hold annotated Mutexes; pybind11's headers are system headers,
    # so they raise no warning; not the tests or tools), and an access to a member annotated
    # HICACHE_GUARDED_BY without its lock, anywhere in them, fails CI here.
    say "fuzz build $dir (clang, libFuzzer + ASan + UBSan, -Wthread-safety)"
    CC=clang CXX=clang++ cmake -S . -B "$dir" -G Ninja -DHICACHE_CUDA=OFF -DHICACHE_BUILD_TESTS=OFF \
      -DHICACHE_BUILD_TOOLS=OFF -DHICACHE_PYTHON=ON -DHICACHE_FUZZ=ON -DHICACHE_WERROR=ON -DHICACHE_THREAD_SAFETY=ON \
      -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
    cmake --build "$dir" -j "$jobs"
    base=${HICACHE_FUZZ_RUNS:-200000}
    # resp talks to a fake server over loopback (about 1000 inputs/s): a tenth of the inputs.
    for spec in "record:$base" "config:$base" "resp:$((base / 10))"; do
      target=${spec%%:*}
      runs=${spec#*:}
      # New inputs go to a scratch corpus; the committed seeds (and past crashes) stay as they are.
      scratch=$(mktemp -d)
      say "fuzzing $target: $runs inputs, seed 1 (seeds: tests/fuzz/corpus/$target)"
      "$dir/tests/fuzz/fuzz_$target" -seed=1 -runs="$runs" -timeout=10 -artifact_prefix="$scratch/" \
        "$scratch" "tests/fuzz/corpus/$target" 2>&1 | tail -3 || {
        say "fuzz_$target found a failing input (kept in $scratch)"; exit 1; }
      rm -rf "$scratch"
    done
  fi
fi
say "done ($mode)"

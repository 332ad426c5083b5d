#!/usr/bin/env bash
# Fails when a file of a lower layer includes a header of a higher one (docs/architecture.md):
#   kernels < transfer < pools < storage < controller < tools < python
# and, inside the Python package (python/hicache), when an import points up or across:
#   the core (every module whose name does not start with an engine's) imports no engine
#   adapter (sglang*, vllm*, lmcache*), and an engine's adapter imports no other engine's;
#   and no module imports hicache._testing (the test doubles, never installed).
set -euo pipefail
root=${1:?usage: layering_check.sh PROJECT_ROOT}
layers=(kernels transfer pools storage controller tools python)
status=0
for i in "${!layers[@]}"; do
  layer=${layers[$i]}
  [ -d "$root/$layer" ] || continue
  for j in "${!layers[@]}"; do
    (( j > i )) || continue
    above=${layers[$j]}
    if hits=$(grep -rnE "#include \"${above}/" "$root/$layer" --include='*.h' --include='*.cc' --include='*.cu' --include='*.cuh'); then
      echo "layer violation: $layer includes $above:"
      echo "$hits"
      status=1
    fi
  done
done

if [ -d "$root/python/hicache" ]; then
  python3 - "$root/python/hicache" <<'PY' || status=1
import ast, pathlib, sys
pkg = pathlib.Path(sys.argv[1])
engines = ("sglang", "vllm", "lmcache")
def engine_of(rel):  # the engine a module belongs to, or None for the core
    first = rel.parts[0]
    return next((e for e in engines if first.startswith(e)), None)
def imported(path, rel):
    """Top-level names inside the package that the module imports (relative or absolute)."""
    here = list(rel.parts[:-1])
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[0] == "hicache" and len(parts) > 1:
                    yield parts[1]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - (node.level - 1)] if node.level > 1 else here
                mod = base + (node.module.split(".") if node.module else [])
            elif node.module and node.module.split(".")[0] == "hicache":
                mod = node.module.split(".")[1:]
            else:
                continue
            if mod:
                yield mod[0]
            else:  # from . import x, y
                for a in node.names:
                    yield a.name
bad = 0
for path in sorted(pkg.rglob("*.py")):
    rel = path.relative_to(pkg)
    mine = engine_of(rel)
    for name in imported(path, rel):
        if name == "_testing":  # the test doubles' module: built for tests/python only
            print(f"layer violation: python/hicache/{rel} imports hicache._testing (tests only)")
            bad = 1
            continue
        theirs = next((e for e in engines if name.startswith(e)), None)
        if theirs and theirs != mine:
            print(f"layer violation: python/hicache/{rel} ({mine or 'core'}) imports {name} ({theirs})")
            bad = 1
sys.exit(bad)
PY
fi
# Inside controller/: the radix cache's rooms (controller/radix/) sit below their coordinator
# and the front door, so they never include them.
if [ -d "$root/controller/radix" ]; then
  if hits=$(grep -rnE '#include "controller/(hi_radix_cache|hicache)\.h"' "$root/controller/radix"); then
    echo "layer violation: controller/radix includes its coordinator:"
    echo "$hits"
    status=1
  fi
fi
# The rooms' tests (tests/controller/radix) test each room alone: under fakes of its hooks,
# never through the coordinator.
if [ -d "$root/tests/controller/radix" ]; then
  if hits=$(grep -rnE '#include "(controller/(hi_radix_cache|hicache)\.h|tests/controller/radix_test_engine\.h)"' "$root/tests/controller/radix"); then
    echo "layer violation: a test of controller/radix goes through the coordinator:"
    echo "$hits"
    status=1
  fi
fi
[ $status -eq 0 ] && echo "layering ok: ${layers[*]}; controller/radix and its tests below its coordinator; python package: core < engine adapters"
exit $status

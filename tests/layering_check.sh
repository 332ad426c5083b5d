#!/usr/bin/env bash
# Fails when a file of a lower layer includes a header of a higher one (docs/architecture.md):
#   kernels < transfer < pools < storage < controller < tools
set -euo pipefail
root=${1:?usage: layering_check.sh PROJECT_ROOT}
layers=(kernels transfer pools storage controller tools)
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
# Inside controller/: the radix cache's rooms (controller/radix/) sit below their coordinator
# and the front door, so they never include them.
if [ -d "$root/controller/radix" ]; then
  if hits=$(grep -rnE '#include "controller/(hi_radix_cache|hicache)\.h"' "$root/controller/radix"); then
    echo "layer violation: controller/radix includes its coordinator:"
    echo "$hits"
    status=1
  fi
fi
[ $status -eq 0 ] && echo "layering ok: ${layers[*]}"
exit $status

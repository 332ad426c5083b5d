#!/usr/bin/env bash
# The table of which test shows each configuration key's effect or refusal
# (tests/controller/config_key_tests.tsv) names only tests ctest runs, and docs/configuration.md
# shows the table as it is. Usage: config_key_tests_check.sh TSV DOC CTEST BUILD_DIR
#
# A name is Suite.Name as ctest lists it; a parameterized test's Suite.Name stands for its
# instances (Prefix/Suite.Name/param). The keys themselves (one row per key of the schema, per
# alias and per key of the store object, storage.<backend>.<key> from the stores' kJsonKeys) are
# checked by ConfigKeyTests.EveryKeyAndAliasHasARowAndEveryRowAKey in controller_test.
set -euo pipefail

tsv=$1 doc=$2 ctest=$3 build=$4
fail=0

# What ctest runs: "  Test  #12: Suite.Name  # GetParam() = ..." -> "Suite.Name".
registered=$(cd "$build" && "$ctest" -N 2>/dev/null |
  sed -n 's/^ *Test *#[0-9]*: \([^ ]*\).*$/\1/p')
if [[ -z $registered ]]; then
  echo "ctest -N in $build listed no tests" >&2
  exit 1
fi
not_built=$(grep '_NOT_BUILT$' <<<"$registered" || true)

is_registered() {
  local name=$1 n
  while IFS= read -r n; do
    [[ $n == "$name" || $n == */"$name"/* ]] && return 0
  done <<<"$registered"
  return 1
}

rows=$(grep -v '^#' "$tsv" | tail -n +2)
while IFS=$'\t' read -r key effect refused extra; do
  if [[ -z $key || -z $effect || -z $refused || -n $extra ]]; then
    echo "$tsv: row '$key' does not have three tab-separated columns" >&2
    fail=1
    continue
  fi
  for column in "$effect" "$refused"; do
    [[ $column == "-" ]] && continue
    IFS=',' read -ra names <<<"$column"
    for name in "${names[@]}"; do
      name=${name# }
      if ! is_registered "$name"; then
        echo "$tsv: key '$key' names '$name', which ctest does not run" >&2
        fail=1
      fi
    done
  done
done <<<"$rows"
if [[ $fail -ne 0 && -n $not_built ]]; then
  echo "(not built, so their tests are unknown: $(tr '\n' ' ' <<<"$not_built"))" >&2
fi

# The rendering docs/configuration.md carries, row for row.
rendered=$(
  echo "| key | effect shown by | refusal shown by |"
  echo "| --- | --- | --- |"
  while IFS=$'\t' read -r key effect refused; do
    echo "| \`$key\` | $effect | $refused |"
  done <<<"$rows"
)
# The doc's table: from its header line to the first line that is not a table row.
shown=$(awk -v header="$(head -n 1 <<<"$rendered")" '
  $0 == header { on = 1 } on && !/^\|/ { exit } on { print }' "$doc")
if [[ $shown != "$rendered" ]]; then
  echo "$doc does not show the table of $tsv as it is; its section must read:" >&2
  echo "$rendered" >&2
  diff <(echo "$shown") <(echo "$rendered") >&2 || true
  fail=1
fi
exit $fail

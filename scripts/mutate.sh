#!/usr/bin/env bash
# `make mutate`: mutation testing of the states/ core with mutmut 3 (docs/testing.md,
# "Mutation testing").
#
# Why this staging tree: mutmut copies the sources to mutants/ and puts mutants/ first on
# sys.path, but it names each mutant after the file's path. Our editable install maps
# twostroke.states to states/, so mutating states/ in place would give mutants named
# states.scheduler... that the tests (importing twostroke.states.scheduler) never switch on,
# and the installed, unmutated states/ would still be imported. So mutmut runs in
# build/mutate, a copy laid out as the wheel installs it (twostroke/states/...): the mutant
# names match the imported modules, and mutants/twostroke/states shadows the editable install
# (a path entry is searched before setuptools' editable finder). cosmic-ray mutates in place
# and needs none of this, but it restarts pytest and reruns the whole suite per mutant
# (hours on two cores); mutmut forks a warm process and runs only the tests that reach the
# mutated function.
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
python="${PYTHON:-$root/.venv/bin/python}"
stage="${MUTATE_DIR:-$root/build/mutate}"
children="${MUTATE_CHILDREN:-2}"

rm -rf "$stage"
mkdir -p "$stage/twostroke" "$stage/tests" "$stage/docs"
cp -r "$root/states" "$stage/twostroke/states"
cp "$root/tests/__init__.py" "$root/tests/conftest.py" "$stage/tests/"
cp -r "$root/tests/states" "$stage/tests/states"
# test_request.py checks that docs/states.md shows the diagram drawn from the code.
cp "$root/docs/states.md" "$stage/docs/"
cp "$root/pyproject.toml" "$stage/"
cp "$root/scripts/mutmut_conftest.py" "$stage/conftest.py"
cp "$root/scripts/mutmut_preload.txt" "$stage/"
find "$stage" -name __pycache__ -prune -exec rm -rf {} +

cd "$stage"
# The unmutated core must pass first (and be the copy: `python -m` puts the cwd first on
# sys.path); otherwise mutmut's stats run fails with no word on which test.
"$python" -c 'import os, sys, twostroke.states as s
where = os.path.realpath(s.__path__[0])
sys.exit(where != os.path.realpath("twostroke/states") and f"twostroke.states comes from {where}")'
"$python" -m pytest tests/states -q -x -p no:cacheprovider --hypothesis-profile=default --timeout=0
start=$(date +%s)
# mutmut exits 0 whatever survived; the gate is the kill ratio, checked below.
if [ -n "${MUTATE_SAMPLE:-}" ]; then
  # A uniform random sample of MUTATE_SAMPLE mutants (seed MUTATE_SEED), for a machine on
  # which the whole run takes hours. mutmut makes every mutant on its first run, so the first
  # run checks only errors.py's few; the sample is drawn from the rest.
  "$python" -m mutmut run --max-children "$children" 'twostroke.states.errors.*'
  "$python" -m mutmut results --all true > results.txt
  mapfile -t sample < <("$python" - "$MUTATE_SAMPLE" "${MUTATE_SEED:-0}" <<'PY'
import random, re, sys

names = [m[1] for line in open("results.txt", encoding="utf-8")
         if (m := re.match(r"\s*(\S+): not checked$", line))]
random.Random(int(sys.argv[2])).shuffle(names)
print("\n".join(sorted(names[: int(sys.argv[1])])))
PY
  )
  "$python" -m mutmut run --max-children "$children" "${sample[@]}"
else
  "$python" -m mutmut run --max-children "$children"
fi
end=$(date +%s)
"$python" -m mutmut results --all true > results.txt
"$python" - "$((end - start))" "${MUTATE_SAMPLE:-}" <<'PY'
import collections, re, sys

sampled = bool(sys.argv[2])
counts = collections.Counter()
survivors = []
for line in open("results.txt", encoding="utf-8"):
    match = re.match(r"\s*(\S+): (.+)$", line)
    if match and match[2] == "not checked" and sampled:
        counts["not checked (outside the sample)"] += 1
    elif match:
        counts[match[2]] += 1
        if match[2] not in ("killed", "timeout"):
            survivors.append(line.strip())
total = sum(n for k, n in counts.items() if not k.startswith("not checked"))
# mutmut files a mutant whose test process hung or died as a timeout: detected, like a kill
# (a mutated validator that breaks every import kills the process before any test reports).
killed = counts["killed"] + counts["timeout"]
print(f"{total} mutants in {sys.argv[1]} s: " + ", ".join(f"{n} {k}" for k, n in counts.most_common()))
print("\n".join(survivors))
ratio = killed / total if total else 0.0
print(f"killed or timed out {killed}/{total} = {ratio:.1%} (gate: 95%)")
sys.exit(0 if ratio >= 0.95 else 1)
PY

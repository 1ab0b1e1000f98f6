#!/usr/bin/env bash
# Validate `scirl export prime-rl` with prime-rl's own config classes.
#
#   scripts/check_primerl_config.sh PRIME_RL_CHECKOUT [check_primerl_config.py options]
#
# PRIME_RL_CHECKOUT is a prime-rl checkout with its deps/verifiers submodule
# (`git submodule update --init deps/verifiers`). prime-rl is not on PyPI, so this
# builds a Python 3.12 venv from the checkout's pure-Python config package
# (packages/prime-rl-configs), its pinned verifiers and, where those submodules are
# checked out, its renderers and pydantic-config (else from PyPI), plus scirl
# (without its ML dependencies: the taskset needs only scirl's data, prompt and
# reward modules) and the sciknoweval package (with its dependency check, so a
# verifiers range that excludes prime-rl's own fails here). It then exports, parses
# the export the way `rl @ grpo.toml` does, and prints the resolved ports.
#
# Environment: PYTHON312 (default python3.12), SCIRL_PRIMERL_VENV (default: a
# venv per prime-rl commit under ${TMPDIR:-/tmp}; reused when it exists).
set -euo pipefail

if [ $# -lt 1 ] || [ ! -d "$1" ]; then
  echo "usage: $0 PRIME_RL_CHECKOUT [check_primerl_config.py options]" >&2
  exit 2
fi
checkout=$(cd "$1" && pwd)
shift
repo=$(cd "$(dirname "$0")/.." && pwd)

if [ ! -f "$checkout/packages/prime-rl-configs/pyproject.toml" ]; then
  echo "$checkout: no packages/prime-rl-configs (not a prime-rl checkout, or one older than the config package)" >&2
  exit 2
fi
if [ ! -f "$checkout/deps/verifiers/pyproject.toml" ]; then
  echo "$checkout/deps/verifiers is empty: run 'git submodule update --init deps/verifiers' in the checkout" >&2
  exit 2
fi

commit=$(git -C "$checkout" rev-parse --short=9 HEAD 2>/dev/null || echo unknown)
venv=${SCIRL_PRIMERL_VENV:-${TMPDIR:-/tmp}/scirl-primerl-check-$commit}
if [ ! -x "$venv/bin/python" ]; then
  python=${PYTHON312:-python3.12}
  if ! "$python" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
    echo "prime-rl-configs needs Python 3.12: set PYTHON312 to a python3.12 executable" >&2
    exit 2
  fi
  echo "creating $venv (prime-rl $commit)" >&2
  "$python" -m venv "$venv"
  pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
  local_deps=("$checkout/deps/verifiers")
  for dep in renderers pydantic-config; do
    if [ -f "$checkout/deps/$dep/pyproject.toml" ]; then local_deps+=("$checkout/deps/$dep"); fi
  done
  "${pip[@]}" "${local_deps[@]}" "$checkout/packages/prime-rl-configs"
  "${pip[@]}" --no-deps -e "$repo"
  # With dependencies: pip must find scirl (installed above) and accept prime-rl's verifiers.
  "${pip[@]}" -e "$repo/packages/sciknoweval"
fi

exec "$venv/bin/python" "$repo/scripts/check_primerl_config.py" --checkout "$checkout" "$@"

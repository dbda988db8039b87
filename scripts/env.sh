# Source me:  source scripts/env.sh
# Exports FSDP_MUON_PYTHON (the python whose torch provides LibTorch), CMAKE_PREFIX_PATH with
# LibTorch, FSDP_MUON_BUILD (the build folder) and puts torchrun on PATH. Installs nothing:
# scripts/setup does that. Which LibTorch, in order: Torch_DIR (set by you), FSDP_MUON_PYTHON
# (set by you), the cached virtual environment scripts/setup made, a python3 whose torch is 2.x.

_fsdp_muon_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
: "${FSDP_MUON_TORCH_VERSION:=2.11.0}"
: "${FSDP_MUON_CACHE:=${XDG_CACHE_HOME:-$HOME/.cache}/fsdp_muon}"
: "${FSDP_MUON_VENV:=$FSDP_MUON_CACHE/venv-torch-$FSDP_MUON_TORCH_VERSION}"
: "${FSDP_MUON_BUILD:=$_fsdp_muon_root/build}"
export FSDP_MUON_TORCH_VERSION FSDP_MUON_CACHE FSDP_MUON_VENV FSDP_MUON_BUILD

_fsdp_muon_has_torch2() {  # $1: a python; true when its torch is 2.x or newer
  "$1" -c 'import sys, torch; sys.exit(0 if int(torch.__version__.split(".")[0]) >= 2 else 1)' \
    >/dev/null 2>&1
}

if [ -z "${FSDP_MUON_PYTHON:-}" ]; then
  if [ -e "$FSDP_MUON_VENV/.fsdp_muon_complete" ] && _fsdp_muon_has_torch2 "$FSDP_MUON_VENV/bin/python"; then
    FSDP_MUON_PYTHON="$FSDP_MUON_VENV/bin/python"
  elif command -v python3 >/dev/null 2>&1 && _fsdp_muon_has_torch2 "$(command -v python3)"; then
    FSDP_MUON_PYTHON="$(command -v python3)"
  fi
fi

if [ -n "${FSDP_MUON_PYTHON:-}" ]; then
  export FSDP_MUON_PYTHON
  _fsdp_muon_torch_prefix="$("$FSDP_MUON_PYTHON" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)' 2>/dev/null)"
  case ":${CMAKE_PREFIX_PATH:-}:" in
    *":$_fsdp_muon_torch_prefix:"*) ;;
    *) export CMAKE_PREFIX_PATH="$_fsdp_muon_torch_prefix${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}" ;;
  esac
  _fsdp_muon_bin="$(dirname "$FSDP_MUON_PYTHON")"
  case ":$PATH:" in
    *":$_fsdp_muon_bin:"*) ;;
    *) export PATH="$_fsdp_muon_bin:$PATH" ;;
  esac
fi
unset _fsdp_muon_root _fsdp_muon_torch_prefix _fsdp_muon_bin

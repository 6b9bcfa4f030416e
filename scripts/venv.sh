# Sourced by scripts/serve and scripts/test: create .venv in the repository root (once) and
# install the project into it, again only when pyproject.toml changed. CPU machines get the
# CPU build of torch (pinned: a bare `torch` would pull a multi-GB CUDA build); GPU boxes use
# the Docker image, which installs the CUDA build and SGLang.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
EXTRAS="${VENV_EXTRAS:-}"  # set by the sourcing script or the caller (VENV_EXTRAS=ray ./scripts/serve); never its own arguments
PYTHON="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
  echo "==> creating $VENV"
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
fi
stamp="$VENV/.telerag-installed${EXTRAS:+-$EXTRAS}"
want="$(sha256sum "$ROOT/pyproject.toml" | cut -d" " -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "==> installing telerag${EXTRAS:+[$EXTRAS]} into $VENV"
  # --no-compile: Python compiles a module when it is first imported, so only what is used gets
  # compiled, not all of torch and transformers at install (measured: 112 s -> 52 s, pip's cache warm)
  "$VENV/bin/python" -m pip install --quiet --no-compile "torch==${TELERAG_TORCH_VERSION:-2.13.0}"
  "$VENV/bin/python" -m pip install --quiet --no-compile -e "$ROOT${EXTRAS:+[$EXTRAS]}"
  echo "$want" > "$stamp"
fi
export PATH="$VENV/bin:$PATH"
# Bytecode is written as each module is first imported (the --no-compile above counts on it),
# so not where PYTHONDONTWRITEBYTECODE is set, as some sandboxes and CI images set it: then every
# process compiles torch and transformers anew, 13 of the 20 CPU-seconds a model's load takes
# here (measured). What these scripts run writes it.
unset PYTHONDONTWRITEBYTECODE
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

#!/usr/bin/env bash
# The built wheel, installed alone (no extras) into a fresh virtual environment, run from a
# directory outside the repository: what a user who runs `pip install kvcache` gets. Fails on any
# error, and on any warning printed by torch or kvcache (a missing dependency shows up as one).
#
#   bash scripts/wheel_smoke.sh            # builds the wheel from this checkout
#   bash scripts/wheel_smoke.sh WHEEL      # a wheel built elsewhere
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
wheel=${1:-}
if [ -z "$wheel" ]; then
  python3 -m pip wheel -q --no-deps -w "$work/dist" "$repo" >/dev/null
  wheel=$(ls "$work"/dist/kvcache-*.whl)
fi
python3 -m venv "$work/venv"
# torch pinned to the CPU build this project is tested with (a bare requirement may pull a CUDA build)
"$work/venv/bin/pip" install -q torch==2.13.0 "$wheel" 2>&1 | grep -v "^WARNING: Location" || true
"$work/venv/bin/python" -c "import kvcache" # the install itself worked
mkdir "$work/elsewhere"
cd "$work/elsewhere"
export PATH="$work/venv/bin:$PATH"

check() {  # run a command; fail when it fails or prints a warning or traceback on stderr
  echo "+ $*"
  if ! "$@" >"$work/out" 2>"$work/err"; then
    cat "$work/out" "$work/err"; echo "wheel smoke: '$*' failed"; exit 1
  fi
  if grep -qiE "warning|traceback" "$work/err"; then
    cat "$work/err"; echo "wheel smoke: '$*' printed a warning"; exit 1
  fi
}

check kvcache --version
check kvcache --help
prompt="The value of the "
check kvcache generate "$prompt" --max-new-tokens 20 --temperature 0
cp "$work/out" "$work/plain"
check kvcache generate "$prompt" --max-new-tokens 0 --save-cache prompt.safetensors
check kvcache generate "$prompt" --max-new-tokens 20 --temperature 0 --cache prompt.safetensors
cmp -s "$work/out" "$work/plain" || { echo "wheel smoke: a resumed run printed other text"; exit 1; }
check kvcache inspect prompt.safetensors
check kvcache inspect --json prompt.safetensors
check kvcache generate "$prompt" --max-new-tokens 20 --temperature 0 --prefix-store store
check kvcache generate "$prompt" --max-new-tokens 20 --temperature 0 --prefix-store store
cmp -s "$work/out" "$work/plain" || { echo "wheel smoke: a prefix-store hit printed other text"; exit 1; }
check kvcache store store
check python -m kvcache store store --clear
check python - <<'PY'
import torch
from kvcache import DynamicCache, load_cache, save_cache
from kvcache.generation import generate
from kvcache.models import load_default_model
from kvcache.store import PrefixStore

model, tokenizer = load_default_model()
prompt = torch.tensor([tokenizer.encode("The value of the ")])
out = generate(model, prompt, max_new_tokens=8)
save_cache(out.cache, "api.safetensors", metadata={"tokens": out.sequences[0].tolist()})
loaded, meta = load_cache("api.safetensors", return_metadata=True)
more = generate(model, out.sequences, cache=loaded, max_new_tokens=8)
assert more.sequences[0, : out.sequences.shape[1]].tolist() == meta["tokens"]
store = PrefixStore(chunk_size=4)
assert generate(model, prompt, max_new_tokens=4, prefix_store=store).sequences.tolist() == \
    generate(model, prompt, max_new_tokens=4, prefix_store=store).sequences.tolist()
assert isinstance(DynamicCache(), DynamicCache)
PY
echo "wheel smoke: passed ($(basename "$wheel"))"

#!/usr/bin/env bash
# End to end: start `coli chat` in tmux, type a prompt, read the reply and the tier panel from the
# captured pane. Usage: tools/e2e_tmux.sh [MODEL_DIR] [PROMPT]
# Without MODEL_DIR: the embedded demo model, else a tiny random container built on the spot.
# Chats and settings go to a temporary directory (COLI_DATA_DIR / COLI_CONFIG_DIR), never yours.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
command -v tmux >/dev/null || { echo "e2e: tmux is not installed (apt-get install -y tmux)" >&2; exit 2; }

WORK=$(mktemp -d)
SESSION="coli-e2e-$$"
cleanup() { tmux kill-session -t "$SESSION" 2>/dev/null || true; rm -rf "$WORK"; }
trap cleanup EXIT

MODEL=${1:-}
PROMPT=${2:-hello world, tell me about the quick brown fox}
if [ -z "$MODEL" ]; then
  MODEL=$($PY -c "from models import default_model; d = default_model(); print(d or '')")
fi
if [ -z "$MODEL" ]; then
  echo "e2e: no demo model in this install; building a tiny random container in $WORK" >&2
  $PY - "$WORK" <<'EOF'
import json, sys
from pathlib import Path
from tests.conftest import tiny_config, write_hf_model
from tests.conftest import tokenizer_files
from core.converter import convert
from models import validate_config
d = Path(sys.argv[1]); src = d / "src"; src.mkdir()
vocab = tokenizer_files(src, 300)
write_hf_model(src, tiny_config(vocab_size=vocab, num_hidden_layers=4, num_experts=16))
convert(src, d / "model", bits=4, validate_config=validate_config)
EOF
  MODEL="$WORK/model"
fi

# `coli chat` once cli.py wires it in; until then the app's own entry point
if $PY -m colibri_tui chat --help >/dev/null 2>&1; then
  CMD="$PY -m colibri_tui chat --model '$MODEL' --threads 1"
else
  CMD="$PY -m colibri_tui.app_cli --model '$MODEL' --threads 1"
fi
echo "e2e: $CMD" >&2
tmux new-session -d -s "$SESSION" -x 160 -y 48 \
  "env COLI_DATA_DIR='$WORK/data' COLI_CONFIG_DIR='$WORK/config' TERM=xterm-256color $CMD; sleep 30"

pane() { tmux capture-pane -p -t "$SESSION"; }
wait_for() {  # wait_for REGEX SECONDS
  local end=$((SECONDS + $2))
  while [ $SECONDS -lt $end ]; do
    if pane | grep -Eq "$1"; then return 0; fi
    sleep 0.3
  done
  echo "e2e: timed out waiting for /$1/; the pane shows:" >&2; pane >&2; return 1
}

wait_for "ready · Enter sends" 120
tmux send-keys -t "$SESSION" -l "$PROMPT"
tmux send-keys -t "$SESSION" Enter
wait_for "ready · [0-9]+ tokens" 300
sleep 0.5
OUT=$(pane)
echo "$OUT"
echo "----"
ok=1
echo "$OUT" | grep -q "${PROMPT:0:20}" || { echo "e2e: the prompt is not in the chat" >&2; ok=0; }
echo "$OUT" | grep -Eq "[0-9]+ tokens · [0-9.]+ tok/s" || { echo "e2e: no finished reply" >&2; ok=0; }
echo "$OUT" | grep -q "hit rate" || { echo "e2e: no tier panel" >&2; ok=0; }
echo "$OUT" | grep -q "Brain map" || { echo "e2e: no Brain map" >&2; ok=0; }
tmux send-keys -t "$SESSION" C-q
[ $ok = 1 ] && echo "e2e: OK (reply streamed, tier panel and Brain map shown)" || exit 1

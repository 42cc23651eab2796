#!/bin/bash
# The gateway ceiling beside its floor: wrk (1 thread, 32 connections, 8 s) against the bare
# Starlette endpoint, kvmeter serve --engine instant (quota on memory, ledger, Prometheus) and the same
# with quota, ledger writes and bus subscribers off, alternated for $ROUNDS rounds (default 3).
# Needs wrk (apt-get install -y wrk). Usage: bench/quota/ceiling_floor.sh
cd "$(dirname "$0")/../.."
WORK=$(mktemp -d /tmp/kvq-floor-XXXX)
ROUNDS=${ROUNDS:-3}
mkdir -p $WORK/h1 $WORK/h2
.venv/bin/python -c "
import sys; sys.path.insert(0,'bench/quota')
import bench_gateway as b, json, pathlib
pathlib.Path('$WORK/tenants.yaml').write_text(b.tenants_yaml())
b.lua_post(pathlib.Path('$WORK/kvm.lua'), json.dumps(b.BODY).encode(), b.KEY)
b.lua_post(pathlib.Path('$WORK/bare.lua'), json.dumps(b.BODY).encode(), None)
"
.venv/bin/python bench/quota/upstream.py --port 18780 > $WORK/up.log 2>&1 &
U=$!
.venv/bin/python bench/quota/serve_variant.py --port 18781 --tenants $WORK/tenants.yaml --ledger-dsn chdb://$WORK/h1/chdb --spool-dir $WORK/h1/spool --engine instant --quota-store memory:// > $WORK/s1.log 2>&1 &
A=$!
.venv/bin/python bench/quota/serve_variant.py --port 18782 --tenants $WORK/tenants.yaml --ledger-dsn chdb://$WORK/h2/chdb --spool-dir $WORK/h2/spool --engine instant --unlimited --diag-null-recorder --diag-no-bus-subscribers > $WORK/s2.log 2>&1 &
B=$!
for p in 18780 18781 18782; do for i in $(seq 90); do curl -s -o /dev/null localhost:$p/ && break; sleep 1; done; done
sleep 3
date -u +%H:%M; cat /proc/loadavg
for r in $(seq $ROUNDS); do
  for t in "bare 18780 /bare bare.lua" "full 18781 /v1/chat/completions kvm.lua" "floor 18782 /v1/chat/completions kvm.lua"; do
    set -- $t
    rps=$(wrk -t1 -c32 -d8s -s $WORK/$4 http://127.0.0.1:$2$3 | grep -E "Requests/sec|Non-2xx" | tr '\n' ' ')
    echo "round $r $1: $rps"
  done
done
cat /proc/loadavg
kill -INT $A $B; kill $U; sleep 3; kill -9 $A $B $U 2>/dev/null
rm -rf "$WORK"

#!/usr/bin/env bash
# A/B of the MoE backward change on the CPU: fresh processes alternating new (e32fa80) / old (ef6ca0c).
cd /tmp/w/ab2
py=/work/main/.venv/bin/python
run() { # tree preset precision steps
  local pp=""; [ "$1" = old ] && pp=/tmp/w/old
  echo "{\"tree\": \"$1\", \"result\": $(PYTHONPATH=$pp $py ab.py $2 $3 1 $4 2>/dev/null | tail -1)}" >> ab.jsonl
}
for r in 1 2 3; do for p in fp8 bf16; do for t in new old; do run $t tiny $p 30; done; done; done
for r in 1 2; do for p in bf16 fp8; do for t in new old; do run $t small $p 6; done; done; done
echo done > ab.done

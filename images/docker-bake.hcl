# Build every moerl image with `docker buildx bake`, from the repository root:
#   MOERL_GIT_SHA=$(git rev-parse HEAD) REGISTRY=<account>.dkr.ecr.<region>.amazonaws.com/moerl \
#     docker buildx bake -f images/docker-bake.hcl --push
# Tags carry the moerl version and the git sha: <registry>/<image>:<version>-<sha12>.
# Targets: cpu, deepep-efa (DeepEP v2, NCCL GIN), deepep-efa-v1 (DeepEP V1, NVSHMEM libfabric),
# trainer and rollout (FROM deepep-efa), and trainer-v1 / rollout-v1 (FROM deepep-efa-v1).
# Component versions are the Dockerfiles' ARG defaults; override one with --set, e.g.
#   --set deepep-efa.args.NCCL_VERSION=v2.31.2-1
# Parsed offline by tests/launch/test_images.py (python-hcl2); not run here (no Docker engine).

variable "REGISTRY" {
  default = "moerl"
}

variable "MOERL_VERSION" {
  default = "0.1.0"
}

variable "MOERL_GIT_SHA" {
  default = "unknown"
}

# Required by the kernel images: the sha256 of the EFA installer tarball each one downloads
# (images/deepep-efa/Dockerfile says how to get it); the v1 target uses installer 1.48.0.
variable "EFA_INSTALLER_SHA256" {
  default = ""
}

variable "EFA_INSTALLER_V1_SHA256" {
  default = ""
}

variable "PLATFORM" {
  default = "linux/amd64"
}

function "tag" {
  params = [name]
  result = "${REGISTRY}/${name}:${MOERL_VERSION}-${substr(MOERL_GIT_SHA, 0, 12)}"
}

group "default" {
  targets = ["cpu", "deepep-efa", "trainer", "rollout"]
}

group "v1" {
  targets = ["deepep-efa-v1", "trainer-v1", "rollout-v1"]
}

target "_common" {
  context   = "."
  platforms = ["${PLATFORM}"]
  args = {
    MOERL_VERSION = "${MOERL_VERSION}"
    MOERL_GIT_SHA = "${MOERL_GIT_SHA}"
  }
  labels = {
    "org.opencontainers.image.source"   = "moerl"
    "org.opencontainers.image.version"  = "${MOERL_VERSION}"
    "org.opencontainers.image.revision" = "${MOERL_GIT_SHA}"
  }
}

target "cpu" {
  inherits   = ["_common"]
  dockerfile = "images/cpu/Dockerfile"
  tags       = [tag("moerl-cpu")]
}

target "deepep-efa" {
  inherits   = ["_common"]
  dockerfile = "images/deepep-efa/Dockerfile"
  args = {
    DEEPEP_VARIANT       = "v2"
    EFA_INSTALLER_SHA256 = "${EFA_INSTALLER_SHA256}"
  }
  tags = [tag("moerl-deepep-efa")]
}

# AWS validated DeepEP V1 on NVSHMEM-libfabric with EFA installer 1.48.0 and NCCL v2.30.4-1
# (deepep-benchmark/deepep.Dockerfile); keep those for this path.
target "deepep-efa-v1" {
  inherits   = ["_common"]
  dockerfile = "images/deepep-efa/Dockerfile"
  args = {
    DEEPEP_VARIANT        = "v1"
    EFA_INSTALLER_VERSION = "1.48.0"
    EFA_INSTALLER_SHA256  = "${EFA_INSTALLER_V1_SHA256}"
    NCCL_VERSION          = "v2.30.4-1"
  }
  tags = [tag("moerl-deepep-efa-v1")]
}

target "trainer" {
  inherits   = ["_common"]
  dockerfile = "images/trainer/Dockerfile"
  contexts = {
    kernel = "target:deepep-efa"
  }
  args = {
    KERNEL_IMAGE = "kernel"
  }
  tags = [tag("moerl-trainer")]
}

target "rollout" {
  inherits   = ["_common"]
  dockerfile = "images/rollout/Dockerfile"
  contexts = {
    kernel = "target:deepep-efa"
  }
  args = {
    KERNEL_IMAGE = "kernel"
  }
  tags = [tag("moerl-rollout")]
}

target "trainer-v1" {
  inherits = ["trainer"]
  contexts = {
    kernel = "target:deepep-efa-v1"
  }
  tags = [tag("moerl-trainer-v1")]
}

target "rollout-v1" {
  inherits = ["rollout"]
  contexts = {
    kernel = "target:deepep-efa-v1"
  }
  tags = [tag("moerl-rollout-v1")]
}

"""Fail the image build when the base image's packages are not the version set the Dockerfile names.

    python3 check_versions.py vllm==0.33.0 torch==2.14.0
    python3 check_versions.py --ascend-soc a3 vllm-ascend==0.23.0 ...

Reads installed distributions' metadata only (importing torch_npu needs the Ascend runtime). A local version label
(``2.14.0+cu130``) matches its public version.

``--ascend-soc 910b|a3`` (the vllm-ascend base) also checks the Atlas generation the base's vllm-ascend kernels were
compiled for: the vllm-ascend images record it as ``SOC_VERSION`` (ascend910b1 in the A2 image, ascend910_9391 in the
``-a3`` one), and an image of the other generation does not run on these nodes.
"""

import os
import sys
from importlib.metadata import PackageNotFoundError, version

# ASCEND_SOC -> the SOC_VERSION prefix of the vllm-ascend images built for it (vllm-ascend's Dockerfile, Dockerfile.a3)
SOC_VERSION_PREFIX = {"910b": "ascend910b", "a3": "ascend910_93"}


def soc_problem(soc: str, soc_version: str | None) -> str | None:
    """Why a base whose SOC_VERSION is ``soc_version`` does not fit ASCEND_SOC=``soc`` (None: it fits)."""
    if soc not in SOC_VERSION_PREFIX:
        return f"ASCEND_SOC={soc!r}: must be one of {', '.join(SOC_VERSION_PREFIX)} (Atlas A2: 910b, Atlas A3: a3)"
    if not soc_version:
        return f"ASCEND_SOC={soc}: the base image sets no SOC_VERSION, so its vllm-ascend build cannot be checked"
    if not soc_version.lower().startswith(SOC_VERSION_PREFIX[soc]):
        return (
            f"ASCEND_SOC={soc} but the base image's vllm-ascend is built for SOC_VERSION={soc_version} "
            f"(expected {SOC_VERSION_PREFIX[soc]}*): use the vllm-ascend image of that generation"
        )
    return None


def main(argv: list[str]) -> int:
    bad = []
    soc = None
    if argv[:1] == ["--ascend-soc"]:
        if len(argv) < 2:
            sys.exit("--ascend-soc needs a value (910b or a3)")
        soc, argv = argv[1], argv[2:]
        problem = soc_problem(soc, os.environ.get("SOC_VERSION"))
        if problem:
            bad.append(problem)
    for arg in argv:
        name, want = arg.split("==")
        try:
            have = version(name)
        except PackageNotFoundError:
            have = "not installed"
        if have.split("+")[0] != want:
            bad.append(f"{name} {have} (the version set says {want})")
    if bad:
        sys.exit("the base image does not match the Dockerfile's version set: " + "; ".join(bad))
    print("base image versions ok:", " ".join(argv))
    if soc:
        print(f"base image SoC ok: ASCEND_SOC={soc}, SOC_VERSION={os.environ['SOC_VERSION']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

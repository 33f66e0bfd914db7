"""Fail the image build when the base image's packages are not the version set the Dockerfile names.

    python3 check_versions.py vllm==0.33.0 torch==2.14.0

Reads installed distributions' metadata only (importing torch_npu needs the Ascend runtime). A local version label
(``2.14.0+cu130``) matches its public version.
"""

import sys
from importlib.metadata import PackageNotFoundError, version

bad = []
for arg in sys.argv[1:]:
    name, want = arg.split("==")
    try:
        have = version(name)
    except PackageNotFoundError:
        have = "not installed"
    if have.split("+")[0] != want:
        bad.append(f"{name} {have} (the version set says {want})")
if bad:
    sys.exit("the base image does not match the Dockerfile's version set: " + "; ".join(bad))
print("base image versions ok:", " ".join(sys.argv[1:]))

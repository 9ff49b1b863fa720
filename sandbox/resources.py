"""Where the package's data files are: the image build inputs and the seccomp profiles.

They live at the repository's top level (`images/`, `seccomp/`); a wheel carries them
inside the package, under `sandbox/_data/` (pyproject's force-include). Every reader
asks here, so a checkout (an editable install included) and an installed wheel find
the same files, and a wheel that left one out fails with a clear error.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from sandbox.contracts.errors import ConfigError

PACKAGE_DIR = Path(str(resources.files("sandbox")))
# Where a wheel puts the top-level folders (pyproject: tool.hatch...force-include).
PACKAGED_DATA = PACKAGE_DIR / "_data"


def source_checkout() -> Path | None:
    """The repository this package is imported from, or None for an installed wheel."""
    root = PACKAGE_DIR.parent
    if (root / "pyproject.toml").is_file() and (root / "images").is_dir():
        return root
    return None


def _data_dir(name: str) -> Path:
    packaged = PACKAGED_DATA / name
    if packaged.is_dir():
        return packaged
    checkout = source_checkout()
    if checkout is not None and (checkout / name).is_dir():
        return checkout / name
    raise ConfigError(
        f"the package's data folder {name}/ is missing: neither {packaged} (an installed "
        f"wheel) nor {PACKAGE_DIR.parent / name} (a source checkout) exists; reinstall sandbox"
    )


def images_dir() -> Path:
    """The image build inputs (`images/`: each image's Dockerfile and lists)."""
    return _data_dir("images")


def seccomp_dir() -> Path:
    """The seccomp profiles (`seccomp/`: Docker's default, the step's, its OCI form)."""
    return _data_dir("seccomp")

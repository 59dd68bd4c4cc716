"""Let vLLM's LLaVA modules import on CPU torch without torchvision (see install.sh).

transformers' `models/pixtral/image_processing_pixtral.py` imports torchvision's functional API
at module level and uses it only in annotations; vLLM's llava.py reaches it through pixtral.py.
This meta-path finder runs that one module's own source with the import replaced by
`tvF = None`. It is installed only into the vLLM environment and acts only while torchvision
cannot be found.
"""

import importlib.abc
import importlib.machinery
import importlib.util
import sys

_TARGET = "transformers.models.pixtral.image_processing_pixtral"
_LINE = "from torchvision.transforms.v2 import functional as tvF"


class _Loader(importlib.abc.SourceLoader):
    def __init__(self, path):
        self.path = path

    def get_filename(self, fullname):
        return self.path

    def get_data(self, path):
        with open(path, "rb") as f:
            src = f.read().decode("utf-8")
        return src.replace(_LINE, "tvF = None  # patched: torchvision absent").encode("utf-8")

    def set_data(self, *args, **kwargs):
        """Write no bytecode of the patched source over the real module's cache."""

    def path_stats(self, path):
        raise OSError  # read no cached bytecode either: always the patched source


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != _TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.origin is None:
            return None
        return importlib.util.spec_from_file_location(
            fullname, spec.origin, loader=_Loader(spec.origin)
        )


if importlib.util.find_spec("torchvision") is None:
    sys.meta_path.insert(0, _Finder())

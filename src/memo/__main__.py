"""`python -m memo`. A rank of a distributed run leaves through `os._exit` once `main` has written its files and
destroyed its process group: the interpreter's teardown would then destroy C++ objects (gloo's threads among
them) in no set order, and a rank was seen to abort there ("terminate called without an active exception")."""

import os
import sys

from .cli import main
from .parallel.mesh import launched

code = main()
if launched():
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
sys.exit(code)

"""Batches (issue 44, part 1): OpenAI's Files and Batch APIs, whose lines run below every
class, a model at a time, while nothing else wants their slots.

| concern                                              | type                     | file      |
|------------------------------------------------------|--------------------------|-----------|
| what the APIs say; a batch's input read line by line | `Batch`, `lines_of`      | shapes.py |
| files, batches and results on disk (state_dir)       | `Store`                  | store.py  |
| running them: grouped by model, sent to the front    | `Runner`                 | runner.py |

What may be imported here: `config/`, the standard library, msgspec and aiohttp (the
runner is a client of corral's own front); nothing above (the management API's
batches_api.py serves them).
"""

from .runner import Runner
from .shapes import Batch, Faults, FileObject, Line, lines_of
from .store import Store, new_id

__all__ = ["Batch", "Faults", "FileObject", "Line", "Runner", "Store", "lines_of", "new_id"]

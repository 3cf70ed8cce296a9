"""The request journal (issue 40): one record of every request the fronts served, kept
in memory (the newest) and in SQLite under `state_dir`, for `GET /requests` and
`corral requests`.

| concern                                          | type                 | file      |
|--------------------------------------------------|----------------------|-----------|
| one request's row as written; its record as read | `Row`, `Record`      | record.py |
| the ring, the file, its writer thread and query  | `Journal`, `Query`   | store.py  |

Records are written off the event loop, in batches, by one thread; a full or broken disk
stops the file (said once in the log), never a request: the ring goes on.

What may be imported here: `config/` and the standard library; nothing above (the
fronts hand their records in, the management API asks).
"""

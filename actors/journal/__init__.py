"""The request journal (issue 40): one record of every request the fronts served, kept
in memory (the newest) and in SQLite under `state_dir`, for `GET /requests` and
`corral requests`.

| concern                                          | type                 | file      |
|--------------------------------------------------|----------------------|-----------|
| one request's row as written; its record as read | `Row`, `Record`      | record.py |
| the ring, the feeder of the file's writer        | `Journal`            | store.py  |
| the file: its layout, bounds, queries            | `Query`, `select`    | file.py   |
| the file's writer, a process of its own          | `main`, `page`       | writer.py |

Records are written off the event loop, in batches, by a process of its own (fed by one
thread); a full or broken disk stops the file (said once in the log), never a request:
the ring goes on.

What may be imported here: `config/` and the standard library; nothing above (the
fronts hand their records in, the management API asks).
"""

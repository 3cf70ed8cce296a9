"""What the actors run on (trio's `_core` habit): the seams between threads, timers, the
event loop, and corral's own files on disk. Nothing here knows a model or a rule.

| concern                                    | type / function        | file           |
|--------------------------------------------|------------------------|----------------|
| actor threads to the event loop, and back  | `LoopReply`, `acquire` | bridge.py      |
| timers that come back as messages          | `Timers`               | timers.py      |
| the event loop: uvloop where installed     | `run`                  | loop.py        |
| a damaged state file: set aside, said once | `set_aside`            | state_files.py |

What may be imported here: `messages` and `base` (the recipients' types, and
`tell_or_drop`); nothing above.
"""

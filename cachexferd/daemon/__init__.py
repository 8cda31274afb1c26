"""The daemon process: sockets, dispatch, ordering, device lifecycle."""

"""Frames out of the job: the recording written on the closing thread, the socket served to
viewers by one thread."""

"""Reading frames: recordings, growing files and sockets (`frame_stream`, `sources`), input
files opened safely, and PyTorch memory snapshots."""

"""Folder put first on the job's PYTHONPATH by `memtui run -- COMMAND`; holds only sitecustomize."""

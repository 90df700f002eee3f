"""`memtui attach` from inside the job: the bootstrap a pending call executes (`boot`) and
the handler that starts or removes the agent on the training thread (`inject`)."""

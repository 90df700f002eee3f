"""The command line: one function per subcommand (`cli`), launching and attaching to jobs,
and opening the TUI. The top layer: it may use every other."""

"""The Textual UI: app, screens and widgets (imported only by commands that open it)."""

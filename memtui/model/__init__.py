"""The pure model of a job: one fold of the frame stream (`recording`), each rank's
`Session`, the `ViewModel` and the rows the views show. No Textual, no I/O."""

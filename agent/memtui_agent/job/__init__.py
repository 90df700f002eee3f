"""What the job has: its module trees and names, its optimizers in order of first step,
and its data-parallel wrappers (DDP/FSDP), and what an optimizer's first step will allocate.
Held weakly: the agent never keeps a job's object alive."""

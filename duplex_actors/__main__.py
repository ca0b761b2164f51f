# Absolute import and a guard: worker processes (anyio.to_process, used by input
# transcription) re-run the main module's file by path under another name, where a relative
# import fails and an unguarded main() would start a second CLI.
from duplex_actors.cli import main

if __name__ == "__main__":
    main()

"""Sans-IO, synchronous, incremental parsers.

Every parser here is fed one piece at a time and returns events; none of them
does I/O, awaits, or keeps a clock. Non-streaming output is ``feed(everything)``
followed by ``finish()``: there is one implementation of each grammar.
"""

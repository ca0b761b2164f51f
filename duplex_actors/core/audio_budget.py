"""What all sessions' input audio may hold together, shared by client.

Each session bounds its own input audio: ``max_input_bytes`` buffered and
``max_committed_bytes`` committed, 120 s each at 16 kHz by default. A client multiplies that by
opening sessions (an address may hold hundreds), many clients multiply it again, and G.711
makes it cheap: 8 kHz mu-law is a byte a sample on the wire and two at 16 kHz once converted.
The figures are in docs/reliability.md.

With a budget, an append (or a created item's audio) is refused as ``input_backpressure``
while the audio held in all is over the budget *and* the client holds more than its fair
share of it (the budget split evenly among the clients with a session open). The clients
that hold the most are refused first; a client holding less than its share is never refused,
however much the others hold, so the clients within their shares hold at most the budget
between them, and the total stays under twice the budget (plus an append). Nothing already
accepted is dropped: a refused client commits, clears or waits for a response to take its
committed audio, as with its own bound.

A response takes the committed audio with it in its engine request (an out-of-band one takes a
copy), which holds it until the engine is done with it: it counts in its client's account from
the response's start until its ``response.done``, and is never refused for the budget, since it
moves audio already counted (a client over its share is refused its next appends meanwhile).
A model-native session's units do the same with each unit of audio: one counts from its
submission until the model has decided on it (or it failed, or was aborted); one promoted to
the turn counts as its response's audio until that response is done. Without it, a client
streaming faster than the engine decides had every unit waiting for a decision uncounted.

Turns waiting for the recogniser hold a copy of their audio of their own, so they count in
the same account while they wait (actors/transcription_queue.py), and a turn that would take a
client over its share of a full budget is refused there: the turn's transcription fails with
a message saying so, the turn itself is not touched.

A client is what the runtime shares by (a session's ``tenant``: an API key, else an address);
a session with no tenant is a client of its own.
"""

from __future__ import annotations

from .client_budget import ClientAccount, ClientBudget

#: The audio budget is a :class:`ClientBudget` counting bytes of pcm16; each client's sessions'
#: buffers (and its turns waiting for the recogniser) report every change to its account.
AudioBudget = ClientBudget
AudioAccount = ClientAccount

__all__ = ["AudioAccount", "AudioBudget"]

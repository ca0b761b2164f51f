// Playback meter for the duplex-actors console: sits between the answer's audio and the
// speakers and counts what is really rendered (not what was scheduled), so the page (and its
// browser test) can tell how much of the answer was heard and when the last audible sample
// left, e.g. after a barge-in stopped playback.
class PlaybackMeter extends AudioWorkletProcessor {
  constructor() {
    super();
    this.audible = 0; // samples rendered with any signal
    this.lastAudibleAt = -1; // currentTime at the end of the last block with signal
    this.blocks = 0;
    this.port.onmessage = () => this.report();
  }

  report() {
    this.port.postMessage({ audible: this.audible, lastAudibleAt: this.lastAudibleAt, rate: sampleRate });
  }

  process(inputs, outputs) {
    const input = inputs[0];
    const output = outputs[0];
    let loud = 0;
    for (let c = 0; c < output.length; c++) {
      const src = input && input[c];
      if (src) {
        output[c].set(src);
        if (c === 0) for (let i = 0; i < src.length; i++) if (Math.abs(src[i]) > 1e-4) loud++;
      } else {
        output[c].fill(0);
      }
    }
    if (loud) {
      this.audible += loud;
      this.lastAudibleAt = currentTime + (output[0] ? output[0].length : 128) / sampleRate;
    }
    if (++this.blocks % 8 === 0) this.report(); // ~every 21 ms at 48 kHz
    return true;
  }
}

registerProcessor("duplex-playback-meter", PlaybackMeter);

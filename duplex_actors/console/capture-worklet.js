// Microphone capture for the duplex-actors console: resamples the AudioContext's input to the
// session's input rate (24 kHz, GA's pcm) and posts pcm16 chunks of `chunkMs` to the page.
// Linear interpolation is enough for speech into a VAD and a recogniser at 16-24 kHz.
class CaptureProcessor extends AudioWorkletProcessor {
  constructor(options) {
    super();
    const opts = options.processorOptions || {};
    this.outRate = opts.outRate || 24000;
    this.step = sampleRate / this.outRate; // input samples per output sample
    this.pos = 0; // fractional read position into `this.tail` + current block
    this.tail = new Float32Array(0); // the input samples not yet consumed
    this.chunk = new Int16Array(Math.round((this.outRate * (opts.chunkMs || 40)) / 1000));
    this.fill = 0;
    this.peak = 0; // loudest sample of the current chunk (the page's level meter)
  }

  process(inputs) {
    const channel = inputs[0] && inputs[0][0];
    if (!channel) return true;
    const data = new Float32Array(this.tail.length + channel.length);
    data.set(this.tail, 0);
    data.set(channel, this.tail.length);
    let pos = this.pos;
    while (pos + 1 < data.length) {
      const i = Math.floor(pos);
      const frac = pos - i;
      let s = data[i] + (data[i + 1] - data[i]) * frac;
      s = Math.max(-1, Math.min(1, s));
      this.peak = Math.max(this.peak, Math.abs(s));
      this.chunk[this.fill++] = s < 0 ? s * 0x8000 : s * 0x7fff;
      if (this.fill === this.chunk.length) {
        const out = this.chunk.slice(0);
        this.port.postMessage({ pcm: out.buffer, peak: this.peak, at: currentTime }, [out.buffer]);
        this.fill = 0;
        this.peak = 0;
      }
      pos += this.step;
    }
    const keep = Math.floor(pos);
    this.tail = data.slice(keep);
    this.pos = pos - keep;
    return true;
  }
}

registerProcessor("duplex-capture", CaptureProcessor);

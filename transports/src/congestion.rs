//! The congestion controller of QUIC links between hosts: Cubic until the
//! link shows loss, BBR from then on.
//!
//! Measured through a userspace netem between two namespaces
//! (bench/HISTORY.md section 9): Cubic reads every lost datagram as
//! congestion, so 1% random loss with 20 ms each way held a 16 MiB transfer
//! at 0.4 MB/s (window near 25 KB), where BBR, which sizes its window from
//! the delivery rate and the minimum RTT, moved 54-90 MB/s. On a clean link
//! BBR was no better and once worse: alternating 16 MiB transfers, it moved
//! 0.6x Cubic's under load 6 on the 2 cores (75-130 against 124-202 MB/s) and
//! matched it at load 1-3 (quinn paces at window / smoothed RTT, and BBR's
//! window follows the minimum RTT, so queueing in a busy host slows its
//! pacing; quinn calls its BBR experimental). Cubic stays where it was never
//! worse; [`Adaptive`] runs both controllers on every event and lets Cubic
//! steer until the loss it saw passes [`LossMeter`]'s threshold; then BBR,
//! which has followed the whole connection, takes over for the rest of it.

use std::any::Any;
use std::sync::Arc;

use quinn::congestion::{BbrConfig, Controller, ControllerFactory, ControllerMetrics, CubicConfig};
use quinn_proto::RttEstimator;
use std::time::Instant;

/// Decides when a connection has seen enough loss to leave Cubic.
#[derive(Debug, Clone, Default)]
pub struct LossMeter {
    sent: u64,
    lost: u64,
    lossy: bool,
}

impl LossMeter {
    /// Lost bytes per million sent above which the link counts as lossy
    /// (0.1%): random loss of a bad link or cable, not one overshoot of a
    /// shallow switch buffer in slow start.
    pub const THRESHOLD_PPM: u64 = 1_000;
    /// Bytes lost before the fraction is trusted (a few datagrams).
    pub const MIN_LOST: u64 = 4 * 1200;

    /// `bytes` were sent.
    pub fn sent(&mut self, bytes: u64) {
        self.sent += bytes;
    }

    /// `bytes` were declared lost; returns whether the link is lossy now.
    pub fn lost(&mut self, bytes: u64) -> bool {
        self.lost += bytes;
        if !self.lossy && self.lost >= Self::MIN_LOST {
            self.lossy = self.lost.saturating_mul(1_000_000) > self.sent.saturating_mul(Self::THRESHOLD_PPM);
        }
        self.lossy
    }

    /// Whether the link was found lossy (for good).
    pub fn lossy(&self) -> bool {
        self.lossy
    }
}

/// Builds [`Adaptive`] controllers (the factory quinn asks per connection).
#[derive(Debug, Default)]
pub struct AdaptiveConfig {
    cubic: Arc<CubicConfig>,
    bbr: Arc<BbrConfig>,
}

impl ControllerFactory for AdaptiveConfig {
    fn build(self: Arc<Self>, now: Instant, current_mtu: u16) -> Box<dyn Controller> {
        Box::new(Adaptive {
            cubic: self.cubic.clone().build(now, current_mtu),
            bbr: self.bbr.clone().build(now, current_mtu),
            meter: LossMeter::default(),
        })
    }
}

/// Cubic, then BBR once the link lost more than [`LossMeter`] allows.
pub struct Adaptive {
    cubic: Box<dyn Controller>,
    bbr: Box<dyn Controller>,
    meter: LossMeter,
}

impl Adaptive {
    fn active(&self) -> &dyn Controller {
        if self.meter.lossy() { &*self.bbr } else { &*self.cubic }
    }
}

impl Controller for Adaptive {
    fn on_sent(&mut self, now: Instant, bytes: u64, last_packet_number: u64) {
        self.meter.sent(bytes);
        self.cubic.on_sent(now, bytes, last_packet_number);
        self.bbr.on_sent(now, bytes, last_packet_number);
    }

    fn on_ack(&mut self, now: Instant, sent: Instant, bytes: u64, app_limited: bool, rtt: &RttEstimator) {
        self.cubic.on_ack(now, sent, bytes, app_limited, rtt);
        self.bbr.on_ack(now, sent, bytes, app_limited, rtt);
    }

    fn on_end_acks(&mut self, now: Instant, in_flight: u64, app_limited: bool, largest_packet_num_acked: Option<u64>) {
        self.cubic
            .on_end_acks(now, in_flight, app_limited, largest_packet_num_acked);
        self.bbr
            .on_end_acks(now, in_flight, app_limited, largest_packet_num_acked);
    }

    fn on_congestion_event(&mut self, now: Instant, sent: Instant, is_persistent_congestion: bool, lost_bytes: u64) {
        self.meter.lost(lost_bytes);
        self.cubic
            .on_congestion_event(now, sent, is_persistent_congestion, lost_bytes);
        self.bbr
            .on_congestion_event(now, sent, is_persistent_congestion, lost_bytes);
    }

    fn on_mtu_update(&mut self, new_mtu: u16) {
        self.cubic.on_mtu_update(new_mtu);
        self.bbr.on_mtu_update(new_mtu);
    }

    fn window(&self) -> u64 {
        self.active().window()
    }

    fn metrics(&self) -> ControllerMetrics {
        self.active().metrics()
    }

    fn clone_box(&self) -> Box<dyn Controller> {
        Box::new(Self {
            cubic: self.cubic.clone_box(),
            bbr: self.bbr.clone_box(),
            meter: self.meter.clone(),
        })
    }

    fn initial_window(&self) -> u64 {
        self.active().initial_window()
    }

    fn into_any(self: Box<Self>) -> Box<dyn Any> {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sends `packets` datagrams of 1200 bytes, losing every `every`-th.
    fn run(meter: &mut LossMeter, packets: u64, every: u64) -> bool {
        for n in 1..=packets {
            meter.sent(1200);
            if every > 0 && n % every == 0 {
                meter.lost(1200);
            }
        }
        meter.lossy()
    }

    #[test]
    fn a_clean_link_stays_with_cubic() {
        assert!(!run(&mut LossMeter::default(), 1_000_000, 0));
    }

    #[test]
    fn one_percent_loss_moves_to_bbr_within_a_few_hundred_datagrams() {
        let mut meter = LossMeter::default();
        assert!(!run(&mut meter, 300, 100), "three losses are not yet enough to judge");
        assert!(run(&mut meter, 200, 100), "1% loss did not count as lossy");
    }

    #[test]
    fn rare_loss_stays_with_cubic_and_the_switch_is_for_good() {
        // 1 in 2000 (0.05%) is under the threshold.
        let mut meter = LossMeter::default();
        assert!(!run(&mut meter, 100_000, 2000));
        // A burst (a slow-start overshoot of 60 datagrams) passes it...
        for _ in 0..60 {
            meter.lost(1200);
        }
        assert!(meter.lossy());
        // ...and a clean stretch after it does not switch back.
        assert!(run(&mut meter, 1_000_000, 0));
    }

    #[test]
    fn the_window_is_cubics_until_the_loss_then_bbrs() {
        let now = Instant::now();
        let mut adaptive = Arc::new(AdaptiveConfig::default()).build(now, 1200);
        let mut cubic = Arc::new(CubicConfig::default()).build(now, 1200);
        let mut bbr = Arc::new(BbrConfig::default()).build(now, 1200);
        let all: [&mut Box<dyn Controller>; 3] = [&mut adaptive, &mut cubic, &mut bbr];
        for c in all {
            for n in 0..100 {
                c.on_sent(now, 1200, n);
            }
        }
        // One lost datagram in 100: under MIN_LOST, still Cubic.
        for c in [&mut adaptive, &mut cubic, &mut bbr] {
            c.on_congestion_event(now, now, false, 1200);
        }
        assert_eq!(adaptive.window(), cubic.window());
        // Ten more: 9% lost, BBR from now on.
        for c in [&mut adaptive, &mut cubic, &mut bbr] {
            c.on_congestion_event(now, now, false, 10 * 1200);
        }
        assert_eq!(adaptive.window(), bbr.window());
        assert_ne!(cubic.window(), bbr.window(), "the test cannot tell the two apart");
    }
}
